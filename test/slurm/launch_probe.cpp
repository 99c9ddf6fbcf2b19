// What a rank of a launched job resolved ([Note: the launch environment] in
// lib/mesh/launch_env.h): joins the world, all-reduces a one (the rendezvous worked when the sum
// is the world size) and prints one line, for test/slurm/sbatch_check.py:
//   probe rank=9 world=16 local_rank=1 local_world=8 backend=gloo device=0 sum=16
//         sources=RANK,WORLD_SIZE,LOCAL_RANK,LOCAL_WORLD_SIZE master=host0:29500 args=a,b
#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include <dtensor/all.h>

#include "mesh/launch_env.h"
#include "mesh/process_group_state.h"

int main(int argc, char** argv) {
  dtensor::init_process_group();
  std::string args; // the program's arguments, as the batch script passed them
  for (int i = 1; i < argc; ++i) {
    args += (i > 1 ? "," : "") + std::string(argv[i]);
  }
  namespace d = dtensor::detail;
  const d::Launch l = d::resolve_launch(dtensor::ProcessGroupOptions(), d::process_env,
                                        d::cuda_device_count(), d::nccl_available());
  const at::Tensor one = at::ones({1}, at::TensorOptions().device(dtensor::default_device()));
  const auto sum = dtensor::all_reduce(one, dtensor::ReduceOp::Sum, dtensor::world_group());
  std::printf("probe rank=%d world=%d local_rank=%d local_world=%d backend=%s device=%d sum=%d "
              "sources=%s,%s,%s,%s master=%s:%s args=%s\n",
              dtensor::get_rank(), dtensor::get_world_size(), dtensor::get_local_rank(),
              l.local_world.value, dtensor::to_string(dtensor::get_backend()).c_str(), l.device,
              static_cast<int>(sum.item<float>()), l.rank.source.c_str(),
              l.world_size.source.c_str(), l.local_rank.source.c_str(),
              l.local_world.source.c_str(), d::process_env("MASTER_ADDR").value_or("").c_str(),
              d::process_env("MASTER_PORT").value_or("").c_str(), args.c_str());
  std::fflush(stdout);
  dtensor::destroy_process_group();
  return 0;
}
