// dtensor's pipeline schedules as text, for test/pipelining/schedules_judge.py, which
// compares them with PyTorch's. Reads commands from stdin, one per line:
//   generate KIND PP MICROBATCHES STAGES_PER_RANK
//     "== KIND PP M V", then "compute" and one line per rank (schedule_to_text), "lowered"
//     and the lowered program, "csv" and schedule_to_csv's rows; or "ERROR <message>".
//   simulate KIND PP MICROBATCHES STAGES_PER_RANK
//     "== simulate KIND PP M V", then "timeline makespan M bubble B peaks P0,P1,..." for unit
//     costs (F = I = W = 1, B = 2, no latency); or "ERROR <message>".
//   timeline KIND PP MICROBATCHES STAGES_PER_RANK
//     as simulate, then "action RANK START END ACTION" per simulated action
//     (scripts/pipeline_timelines.py draws them for docs/pipeline.md).
//   simulate-heavy KIND PP MICROBATCHES STAGES_PER_RANK STAGE FACTOR
//     as simulate, with ScheduleCosts::action_cost making STAGE's actions FACTOR times the
//     unit costs (every other stage falls back to them).
//   lower-csv PATH NUM_STAGES MICROBATCHES
//     "== lower-csv PATH", then "lowered" and the program lower_schedule makes of the CSV's
//     compute schedule; or "ERROR <message>".
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

#include <dtensor/error.h>
#include <dtensor/pipeline_schedule.h>

namespace {

void generate(std::istringstream& in) {
  std::string kind;
  int pp = 0, m = 0, v = 0;
  in >> kind >> pp >> m >> v;
  std::cout << "== " << kind << " " << pp << " " << m << " " << v << "\n";
  try {
    auto k = dtensor::schedule_kind(kind);
    auto order = dtensor::generate_schedule(k, pp, m, v);
    auto lowered = dtensor::lower_schedule(order, pp * v, m);
    std::cout << "compute\n"
              << dtensor::schedule_to_text(order) << "lowered\n"
              << dtensor::schedule_to_text(lowered) << "csv\n"
              << dtensor::schedule_to_csv(order);
  } catch (const dtensor::Error& e) {
    std::cout << "ERROR " << e.what() << "\n";
  }
}

void simulate(std::istringstream& in, bool timed, bool heavy) {
  std::string kind;
  int pp = 0, m = 0, v = 0, stage = -1;
  double factor = 1.0;
  in >> kind >> pp >> m >> v;
  if (heavy) {
    in >> stage >> factor;
  }
  std::cout << "== simulate " << kind << " " << pp << " " << m << " " << v << "\n";
  try {
    auto order = dtensor::generate_schedule(dtensor::schedule_kind(kind), pp, m, v);
    dtensor::ScheduleCosts costs;
    if (heavy) {
      costs.action_cost([stage, factor](const dtensor::PipelineAction& a) {
        const bool full = a.type == dtensor::ActionType::FullBackward;
        return a.stage == stage ? factor * (full ? 2.0 : 1.0) : -1.0;
      });
    }
    auto t = dtensor::simulate_schedule(order, pp * v, costs);
    std::cout << "timeline makespan " << t.makespan << " bubble " << t.bubble_fraction << " peaks ";
    for (size_t r = 0; r < t.peak_activations.size(); ++r) {
      std::cout << (r ? "," : "") << t.peak_activations[r];
    }
    std::cout << "\n";
    if (timed) {
      for (const auto& a : t.actions) {
        std::cout << "action " << a.rank << " " << a.start << " " << a.end << " " << a.action.str()
                  << "\n";
      }
    }
  } catch (const dtensor::Error& e) {
    std::cout << "ERROR " << e.what() << "\n";
  }
}

void lower_csv(std::istringstream& in) {
  std::string path;
  int stages = 0, m = 0;
  in >> path >> stages >> m;
  std::cout << "== lower-csv " << path << "\n";
  try {
    std::ifstream f(path);
    std::stringstream text;
    text << f.rdbuf();
    auto order = dtensor::schedule_from_csv(text.str(), path);
    std::cout << "lowered\n"
              << dtensor::schedule_to_text(dtensor::lower_schedule(order, stages, m));
  } catch (const dtensor::Error& e) {
    std::cout << "ERROR " << e.what() << "\n";
  }
}

} // namespace

int main() {
  std::cout << std::setprecision(17);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "generate") {
      generate(in);
    } else if (cmd == "simulate" || cmd == "timeline" || cmd == "simulate-heavy") {
      simulate(in, cmd == "timeline", cmd == "simulate-heavy");
    } else if (cmd == "lower-csv") {
      lower_csv(in);
    } else if (!cmd.empty()) {
      std::cerr << "dump_orders: unknown command '" << cmd << "'\n";
      return 2;
    }
  }
  std::cout << "== end\n";
  return 0;
}
