"""dtensor's pipeline schedules against PyTorch's, as text (docs/pipeline.md).

usage: schedules_judge.py DUMP_ORDERS

PyTorch (torch.distributed.pipelining from this venv) builds every schedule on a grid of
(pipeline ranks, microbatches, stages per rank) with stand-ins for its stages: the schedule
constructors read only num_stages, group_size, group_rank and submod from them, so no process
group is needed, and the multi-stage schedules lower themselves on construction. DUMP_ORDERS
(test/pipelining/dump_orders.cpp) prints dtensor's generate_schedule / lower_schedule for the
same grid. Compared, per grid point and rank:
- the shapes each side refuses (1F1B with fewer microbatches than stages, Interleaved with
  microbatches not a multiple of the rounds, ZBV and DualPipeV without two stages per rank,
  DualPipeV with fewer microbatches than stages): the same points, both sides;
- the compute order (idle steps included for the multi-stage schedules; GPipe's and 1F1B's
  PyTorch gives without idle steps and with REDUCE_GRAD appended, compared without both);
  1F1B's last rank as PyTorch's known slip, forwards numbered from 1, asserted exactly so a
  fix upstream shows here;
- the lowered program of every multi-stage schedule (UNSHARD/RESHARD, REDUCE_GRAD, SEND/RECV,
  WAIT_SEND), action for action;
- the CSV: dtensor's bytes equal PyTorch's _dump_csv, and PyTorch's _load_csv of dtensor's
  file gives back PyTorch's own order;
- a compute schedule that deadlocks across ranks (each rank's order valid on its own):
  refused by both lowerings before anything runs;
- the timed simulation with unit costs (F = I = W = 1, B = 2): the bubble fraction equals the
  closed forms where they hold ((p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(v m+p-1) for
  Interleaved 1F1B and LoopedBFS, m >= p; (p-1)/(3 v m+p-1) for Interleaved zero-bubble,
  m >= p; (p-1)/(6m+p-1) for ZBV, m >= 3p/2; 2(p-1)/(6m+2(p-1)) for DualPipeV), and each
  rank's peak of live activations equals PyTorch's analyze_pipeline_activation_liveness
  (GPipe: m; 1F1B: min(m, p-r)).
"""
from fractions import Fraction
import os
import subprocess
import sys
import tempfile

import torch  # noqa: F401  (loads the pipelining package's dependencies)
from torch.distributed.pipelining import schedules as S

DUMP = sys.argv[1]
KINDS = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
         "DualPipeV"]
SINGLE = {"GPipe", "1F1B"}
V_STYLE = {"ZBVZeroBubble", "DualPipeV"}


class StageStandIn:
    """The attributes a schedule constructor reads from a pipeline stage."""

    def __init__(self, index, num_stages, pp):
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = 0
        self.submod = None
        self.stage_index_to_group_rank = {}


def text(order, ranks):
    return ["," .join("_" if a is None else str(a) for a in order[r]) for r in range(ranks)]


def torch_side(kind, pp, m, v):
    """(compute lines, lowered lines or None, schedule object) or the error text."""
    cls = S.get_schedule_class(kind)
    stages_total = pp * v
    try:
        if kind in SINGLE:
            if v != 1:
                return "single-stage"
            sched = cls(StageStandIn(0, stages_total, pp), m)
            compute = [",".join(str(a) for a in sched.pipeline_order[r]
                                if a.computation_type not in (S.REDUCE_GRAD, S.WAIT_REDUCE_GRAD))
                       for r in range(pp)]
            return compute, None, sched
        style = "v" if kind in V_STYLE else "loop"
        local = S.generate_rank_to_stage_mapping(pp, stages_total, style=style).get(0, [])
        sched = cls([StageStandIn(s, stages_total, pp) for s in local], m)
        return text(sched.pipeline_order, pp), text(sched.pipeline_order_with_comms, pp), sched
    except (ValueError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"


def dtensor_side(commands):
    out = subprocess.run([DUMP], input="\n".join(commands) + "\n", capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"{DUMP} failed ({out.returncode}):\n{out.stderr}")
    blocks, current = [], None
    for line in out.stdout.splitlines():
        if line.startswith("== "):
            current = {"head": line[3:], "sections": {}, "error": None, "section": None, "timeline": None}
            blocks.append(current)
        elif line.startswith("ERROR "):
            current["error"] = line[6:]
        elif line.startswith("timeline "):
            current["timeline"] = line
        elif line in ("compute", "lowered", "csv"):
            current["section"] = line
            current["sections"][line] = []
        else:
            current["sections"][current["section"]].append(line)
    assert blocks[-1]["head"] == "end", "dump_orders did not finish"
    return blocks[:-1]


def fixed_1f1b_last_rank(line):
    """PyTorch's exported 1F1B order numbers the last rank's forwards 1..m."""
    out = []
    for a in line.split(","):
        act = S._Action.from_str(a)
        if act.computation_type == S.F:
            act = S._Action(act.stage_index, act.computation_type, act.microbatch_index + 1)
        out.append(str(act))
    return ",".join(out)


grid = [(k, pp, m, v) for k in KINDS for pp in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 8)
        for v in ((1,) if k in SINGLE else (1, 2, 3))]
ours = dtensor_side([f"generate {k} {pp} {m} {v}" for k, pp, m, v in grid])
assert len(ours) == len(grid), (len(ours), len(grid))
counts = {"built": 0, "refused": 0, "lowered": 0, "csv": 0}
built = {}
tmp = tempfile.mkdtemp()
for (kind, pp, m, v), mine in zip(grid, ours):
    point = f"{kind} pp={pp} m={m} v={v}"
    assert mine["head"] == f"{kind} {pp} {m} {v}", (mine["head"], point)
    theirs = torch_side(kind, pp, m, v)
    if isinstance(theirs, str):
        assert mine["error"], f"{point}: PyTorch refuses ({theirs}), dtensor built it"
        counts["refused"] += 1
        continue
    assert not mine["error"], f"{point}: PyTorch builds it, dtensor refuses: {mine['error']}"
    compute, lowered, sched = theirs
    got = mine["sections"]["compute"]
    if kind in SINGLE:
        got = [",".join(a for a in line.split(",") if a != "_") for line in got]
    for r in range(pp):
        expect = compute[r]
        if kind == "1F1B" and r == pp - 1:
            assert expect == fixed_1f1b_last_rank(got[r]), (point, r, expect, got[r])
            continue
        assert got[r] == expect, f"{point} rank {r} compute:\n  PyTorch {expect}\n  dtensor {got[r]}"
    counts["built"] += 1
    built[(kind, pp, m, v)] = sched
    if lowered is not None:
        mine_lowered = mine["sections"]["lowered"]
        for r in range(pp):
            assert mine_lowered[r] == lowered[r], \
                f"{point} rank {r} lowered:\n  PyTorch {lowered[r]}\n  dtensor {mine_lowered[r]}"
        counts["lowered"] += 1
        # CSV: PyTorch's file byte for byte, and PyTorch reads dtensor's back to its order.
        theirs_csv = os.path.join(tmp, "theirs.csv")
        sched._dump_csv(theirs_csv, format="compute_only")
        with open(theirs_csv, newline="") as f:
            assert f.read() == "\r\n".join(mine["sections"]["csv"]) + "\r\n", f"{point}: CSV differs"
        ours_csv = os.path.join(tmp, "ours.csv")
        with open(ours_csv, "w", newline="") as f:
            f.write("\r\n".join(mine["sections"]["csv"]) + "\r\n")
        before = text(sched.pipeline_order, pp)
        sched._load_csv(ours_csv, format="compute_only")
        assert text(sched.pipeline_order, pp) == before, f"{point}: PyTorch reads dtensor's CSV differently"
        counts["csv"] += 1

# A compute schedule valid rank by rank that deadlocks: rank 1 starts with microbatch 1,
# whose input rank 0 sends only after a backward that needs rank 1's microbatch 0.
deadlock = os.path.join(tmp, "deadlock.csv")
with open(deadlock, "w", newline="") as f:
    f.write("0F0,0B0,0F1,0B1\r\n1F1,1F0,1B0,1B1\r\n")
[mine] = dtensor_side([f"lower-csv {deadlock} 2 2"])
assert mine["error"] and "deadlocks" in mine["error"] and "rank 0 at 0B0" in mine["error"] \
    and "rank 1 at 1F1" in mine["error"], mine
order = {r: [S._Action.from_str(a) for a in row.split(",")]
         for r, row in enumerate(["0F0,0B0,0F1,0B1", "1F1,1F0,1B0,1B1"])}
try:
    S._add_send_recv(order, lambda s: s, 2)
    sys.exit("PyTorch lowered the deadlocking schedule")
except AssertionError as e:
    assert "Malformed compute schedule" in str(e), e
print(f"schedules: {counts['built']} grid points equal PyTorch's ({counts['lowered']} lowered, "
      f"{counts['csv']} CSV both ways), {counts['refused']} refused by both; deadlock refused by both")
print(f"deadlock: {mine['error']}")


def closed_form(kind, p, m, v):
    """The textbook bubble fraction with unit costs, where it holds exactly (else None)."""
    if kind in SINGLE:
        return Fraction(p - 1, m + p - 1)
    if kind in ("Interleaved1F1B", "LoopedBFS") and m >= p:
        return Fraction(p - 1, v * m + p - 1)
    if kind == "InterleavedZeroBubble" and m >= p:
        return Fraction(p - 1, 3 * v * m + p - 1)
    if kind == "ZBVZeroBubble" and 2 * m >= 3 * p:
        return Fraction(p - 1, 6 * m + p - 1)
    if kind == "DualPipeV":
        return Fraction(2 * (p - 1), 6 * m + 2 * (p - 1))
    return None


def local_stages(kind, p, v, r):
    style = "v" if kind in V_STYLE else "loop"
    return S.generate_rank_to_stage_mapping(p, p * v, style=style)[r]


sim_grid = sorted(built) + [("Interleaved1F1B", 4, 8, 2), ("InterleavedZeroBubble", 4, 8, 2),
                            ("ZBVZeroBubble", 4, 8, 2), ("DualPipeV", 4, 8, 2), ("1F1B", 4, 8, 1),
                            ("ZBVZeroBubble", 8, 32, 2), ("Interleaved1F1B", 8, 32, 2)]
timed = dtensor_side([f"simulate {k} {p} {m} {v}" for k, p, m, v in sim_grid])
forms = 0
for (kind, p, m, v), mine in zip(sim_grid, timed):
    point = f"{kind} pp={p} m={m} v={v}"
    assert not mine["error"], (point, mine["error"])
    line = mine["timeline"]
    assert line, (point, mine)
    fields = line.split()
    makespan, bubble = float(fields[2]), float(fields[4])
    peaks = [int(x) for x in fields[6].split(",")]
    # every rank does 3 v m units of work
    assert abs(makespan * (1 - bubble) - 3 * v * m) < 1e-9, (point, line)
    form = closed_form(kind, p, m, v)
    if form is not None:
        assert abs(bubble - float(form)) < 1e-12, f"{point}: bubble {bubble}, closed form {form}"
        forms += 1
    if kind == "GPipe":
        expect = [m] * p
    elif kind == "1F1B":
        expect = [min(m, p - r) for r in range(p)]
    else:
        sched = built.get((kind, p, m, v))
        if sched is None:
            local = local_stages(kind, p, v, 0)
            sched = S.get_schedule_class(kind)([StageStandIn(s, p * v, p) for s in local], m)
        expect = [S.analyze_pipeline_activation_liveness(sched, pp_rank=r, stage_indices=local_stages(kind, p, v, r),
                                                         granularity="stage_microbatch").num_slots
                  for r in range(p)]
    assert peaks == expect, f"{point}: peak activations {peaks}, PyTorch's liveness {expect}"
reference = {("Interleaved1F1B", 4, 8, 2): 57, ("InterleavedZeroBubble", 4, 8, 2): 51,
             ("ZBVZeroBubble", 4, 8, 2): 51, ("DualPipeV", 4, 8, 2): 54, ("1F1B", 4, 8, 1): 33}
for (kind, p, m, v), mine in zip(sim_grid, timed):
    if (kind, p, m, v) in reference:
        assert float(mine["timeline"].split()[2]) == reference[(kind, p, m, v)], (kind, mine["timeline"])
print(f"timeline: {len(sim_grid)} schedules timed with unit costs, {forms} bubbles equal their closed form, "
      "every rank's peak activations equal PyTorch's liveness analysis")

# Per-stage costs (ScheduleCosts::action_cost): one stage h of p made `a` times the unit costs
# (F = a, B = 2a), a far above the other stages' work. Judged by the bottleneck argument, not
# by another simulation: the heavy stage never waits once started (1F1B: the gradient it needs
# comes back while it runs its next forward, and the stage before it is one microbatch ahead;
# GPipe: after its forwards it waits for the first gradient to cross the stages behind it),
# so with unit costs elsewhere
#   1F1B:  makespan = 3 a m + 3 h      (h forwards before it, h backwards after it)
#   GPipe: makespan = 3 a m + 3 (p - 1)
p, m, a = 4, 8, 20
heavy_grid = [(kind, h) for kind in ("1F1B", "GPipe") for h in range(p)]
heavy = dtensor_side([f"simulate-heavy {k} {p} {m} 1 {h} {a}" for k, h in heavy_grid])
for (kind, h), mine in zip(heavy_grid, heavy):
    assert not mine["error"], (kind, h, mine["error"])
    makespan = float(mine["timeline"].split()[2])
    expect = 3 * a * m + (3 * h if kind == "1F1B" else 3 * (p - 1))
    assert makespan == expect, f"{kind} p={p} m={m}, stage {h} x{a}: makespan {makespan}, expected {expect}"
print(f"per-stage costs: {len(heavy_grid)} schedules with one heavy stage, makespans equal the bottleneck forms")
