"""Compares the two sides' records key by key and rank by rank.

Outcome per key (the worst over ranks):
  identical            both ran; placements, collective counts and local values equal
                       (bitwise), and the global value equals the reference
  within tolerance     the same, with values equal within the scenario's tolerance
  both raise           PyTorch and dtensor both refuse the input
  dtensor right, PyTorch raises / PyTorch wrong
                       dtensor's value equals the reference (the plain op on the full
                       tensors); PyTorch refuses it, or gives another value
  by design: <reason>  a difference the scenario explains (by_design())
  DIFFERS: <what>      anything else: the suite fails
"""
import json
import os

import torch

OK_KINDS = ("identical", "within tolerance", "both raise", "dtensor right, PyTorch raises",
            "dtensor right, PyTorch wrong")


def _load(path):
    return torch.load(path, weights_only=False) if os.path.exists(path) else {}


def _close(a, b, tol):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b, a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, False
    if a.numel() == 0:
        return True, True
    if torch.equal(a, b):
        return True, True
    if a.is_floating_point():
        rtol, atol = tol
        # The scale of b's finite values (an inf in b must not make every value close).
        scale = max(1.0, float(b.abs().nan_to_num(0.0, 0.0, 0.0).max()))
        return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol * scale,
                                   equal_nan=True)), False
    return False, False


def _dev(a, b):
    """Largest absolute difference, relative to b's largest magnitude (at least 1)."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    diff = (a.double() - b.double()).abs()
    diff = torch.where(torch.isnan(a.double()) & torch.isnan(b.double()), 0.0, diff)
    return float(diff.nan_to_num(float("inf")).max()) / max(1.0, float(b.abs().max()))


class Report:
    def __init__(self):
        self.outcomes = {}  # key -> outcome
        self.details = {}   # key -> detail for non-identical outcomes

    def set(self, key, outcome, detail=""):
        rank = lambda o: (0 if o == "identical" else 1 if o in OK_KINDS or
                          o.startswith("by design") else 2)
        old = self.outcomes.get(key)
        if old is None or rank(outcome) > rank(old):
            self.outcomes[key] = outcome
            if detail:
                self.details[key] = detail

    def ok(self):
        return all(not o.startswith("DIFFERS") for o in self.outcomes.values())

    def tally(self):
        t = {}
        for o in self.outcomes.values():
            t[o] = t.get(o, 0) + 1
        return dict(sorted(t.items(), key=lambda kv: -kv[1]))

    def print(self):
        for key, o in self.outcomes.items():
            if o not in ("identical", "within tolerance"):
                print(f"  {o:40s} {key}  {self.details.get(key, '')}")
        print(f"[conformance] {len(self.outcomes)} records: " +
              ", ".join(f"{n} {o}" for o, n in self.tally().items()))

    def write_summary(self, directory, scenario, world):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{scenario}-w{world}.json")
        data = {"scenario": scenario, "world": world, "tally": self.tally(), "notes": {
            k: f"{o}: {self.details.get(k, '')}" for k, o in self.outcomes.items()
            if o not in ("identical", "within tolerance", "both raise")}}
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def _load_json(path):
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def compare_record(mod, key, t, d, ref, tol):
    """(outcome, detail) for one key on one rank."""
    t_err, d_err = "error" in t, "error" in d
    by_design = getattr(mod, "by_design", lambda *a: None)
    if t_err and d_err:
        return "both raise", f"torch: {t['error']} | dtensor: {d['error']}"
    if d_err:
        reason = by_design(key, t, d, "dtensor raises")
        if reason:
            return f"by design: {reason}", d["error"]
        return "DIFFERS: dtensor raises", d["error"]
    # dtensor ran: its value against the reference first. Where PyTorch itself is as far from
    # the reference (low precision against an fp32 reference), that distance is the measure.
    if ref is not None and "full" in d:
        same, _ = _close(d["full"], ref, tol)
        if not same and not (isinstance(t.get("full"), torch.Tensor) and
                             _dev(d["full"], ref) <= 1.5 * _dev(t["full"], ref) + tol[1]):
            return "DIFFERS: dtensor's value is not the plain op's", \
                f"max deviation {_dev(d['full'], ref):.3g} (PyTorch's {_dev(t['full'], ref):.3g})" \
                if isinstance(t.get("full"), torch.Tensor) else ""
    # A value record (no tensor) with a reference: dtensor's value must be it.
    if ref is not None and "value" in d and "full" not in d and \
            not isinstance(ref, torch.Tensor) and d["value"] != ref:
        return "DIFFERS: dtensor's value is not the reference", f"{d['value']} vs {ref}"
    if t_err:
        if ref is not None:
            return "dtensor right, PyTorch raises", t["error"]
        return "DIFFERS: PyTorch raises, dtensor runs", t["error"]
    if ref is not None and "full" in t and not _close(t["full"], ref, tol)[0] and \
            _dev(t["full"], ref) > 10 * tol[1]:
        return "dtensor right, PyTorch wrong", "PyTorch's value differs from the plain op's"
    diffs = []
    exact = True
    for field in ("placements", "shape", "value"):
        if field in t and t.get(field) != d.get(field):
            diffs.append(f"{field}: torch {t.get(field)} dtensor {d.get(field)}")
    if t.get("counts", {}) != d.get("counts", {}) and ("counts" in t or "counts" in d):
        diffs.append(f"counts: torch {t.get('counts', {})} dtensor {d.get('counts', {})}")
    for field in ("full", "local"):
        if field == "local" and "P" in str(t.get("placements", "")):
            continue  # a Partial value's split over ranks is the implementation's choice
        if field in t:
            same, bitwise = _close(t[field], d.get(field), tol)
            if not same:
                diffs.append(f"{field} values")
            exact = exact and bitwise
    if diffs:
        detail = "; ".join(diffs)
        reason = by_design(key, t, d, detail)
        if reason:
            return f"by design: {reason}", detail
        return "DIFFERS", detail
    return ("identical" if exact else "within tolerance"), ""


def compare(mod, out, world):
    refs = _load(os.path.join(out, "ref.pt"))
    mod.WORLD = world  # by_design() may depend on it (one-rank meshes)
    tol = getattr(mod, "TOL", (1e-5, 1e-6))
    report = Report()
    for r in range(world):
        t_recs = _load(os.path.join(out, "torch", f"rank{r}.pt"))
        d_recs = _load(os.path.join(out, "dtensor", f"rank{r}.pt"))
        # A case that raised part-way records CASE#error; its later keys exist on one side only.
        t_err = [k[: -len("#error")] for k in t_recs if k.endswith("#error")]
        d_err = [k[: -len("#error")] for k in d_recs if k.endswith("#error")]
        for key in sorted(set(t_recs) | set(d_recs)):
            ref = refs.get(f"{key}@{r}", refs.get(key))  # per-rank references: KEY@RANK
            if key not in d_recs:
                if key.endswith("#error"):
                    report.set(key, "dtensor right, PyTorch raises", t_recs[key]["error"])
                elif not any(key.startswith(e) for e in d_err) and \
                        "error" not in d_recs.get(key.rsplit("#", 1)[0] + "#0", {}):
                    report.set(key, "DIFFERS: missing on dtensor's side", f"rank {r}")
                continue
            if key not in t_recs:
                if key.endswith("#error"):
                    report.set(key, "DIFFERS: dtensor raises", d_recs[key]["error"])
                elif any(key.startswith(e) for e in t_err) or \
                        "error" in t_recs.get(key.rsplit("#", 1)[0] + "#0", {}):
                    outcome, detail = compare_record(mod, key, {"error": "(PyTorch raised)"},
                                                     d_recs[key], ref, tol)
                    report.set(key, outcome, detail)
                else:
                    report.set(key, "DIFFERS: missing on PyTorch's side", f"rank {r}")
                continue
            tk = mod.tolerance(key) if hasattr(mod, "tolerance") else tol
            outcome, detail = compare_record(mod, key, t_recs[key], d_recs[key], ref, tk)
            report.set(key, outcome, (f"rank {r}: " + detail) if detail else "")
    if not report.outcomes:
        report.set("(no records)", "DIFFERS: neither side wrote anything")
    return report
