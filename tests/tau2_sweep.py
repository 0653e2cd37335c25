"""The full differential sweep of tests/test_tau2_orchestrator.py: every behaviour on every task of the base split
of each tau2 domain (retail 114, airline 50, telecom 114), our loop against tau2's own Orchestrator.

    python tests/tau2_sweep.py [--domains retail airline telecom] [--n-tasks N] [--tasks-dir ../shared/tau2]

Prints, per domain and behaviour, the episodes, how many scored 1 and how many disagree; exits 1 on any
disagreement (each one is printed)."""

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import env  # noqa: E402
import test_tau2_orchestrator as diff  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("sweep")
    g.add_argument("--domains", nargs="+", default=list(env.TAU2_DOMAINS), choices=env.TAU2_DOMAINS,
                   help="tau2 domains to sweep")
    g.add_argument("--n-tasks", type=int, default=None, help="the first N tasks of each base split (default: all)")
    g.add_argument("--tasks-dir", default=None, help="a folder of tau2 task sets, <dir>/<domain>/tasks.json (e.g. "
                   "../shared/tau2: v1.0.x's retail and airline), played on the installed tau2's code; a domain "
                   "without one keeps the installed tau2's tasks")
    g.add_argument("--out", default=None, help="write every row (task, behaviour, ours, theirs) to this JSON file")
    a = p.parse_args(argv)
    every, bad = [], []
    for name in a.domains:
        t0 = time.time()
        path = Path(a.tasks_dir) / name / "tasks.json" if a.tasks_dir else None
        path = path if path is not None and path.is_file() else None
        if path is not None:  # its database beside it, if there
            db = path.parent / "db.json"
            diff._domains[name] = env.Tau2(name, db=db if db.is_file() else None)
        tasks = diff.domain(name).tasks("base", path=path)[:a.n_tasks]
        rows, disagree = diff.compare(name, tasks)
        every += [(name, *r) for r in rows]
        bad += disagree
        count = collections.Counter((r[1], r[2][0] == 1.0) for r in rows)
        ends = collections.Counter((r[1], r[2][1]) for r in rows)
        print(f"{name} ({diff.domain(name).task_set}): {len(tasks)} tasks, {len(rows)} episodes, "
              f"{len(disagree)} disagreements ({time.time() - t0:.0f} s)")
        for b in diff.BEHAVIOURS:
            print(f"  {b:22s} reward 1: {count[(b, True)]:4d}/{count[(b, True)] + count[(b, False)]:<4d} ends: "
                  + ", ".join(f"{e} {n}" for (b2, e), n in sorted(ends.items()) if b2 == b))
        for r in disagree:
            print(f"  DISAGREE {r}")
        sys.stdout.flush()
    if a.out:
        Path(a.out).write_text(json.dumps(every, indent=1))
    print(f"total: {len(every)} episodes, {len(bad)} disagreements (tau2 {diff.domain(a.domains[0]).version})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
