"""
MUA-RL's user-in-the-loop claim in miniature: does RL with a user who reveals information only when asked and
changes their mind teach more than RL with a cooperative user, or than the same compute spent on more SFT?

    python tests/user_study.py                          # seeds 0 1 2 into runs/user_study (alone on the CPU)
    python tests/user_study.py --report runs/user_study # only the table, from finished runs

Per seed S (every command the README's, with `--seed S`):
    synth.py --user cooperative        cold-start data from a user who states everything up front
    sft.py                             from the committed base, on that data
    grpo.py                            MUA-RL: the dynamic scripted user (asks to be asked, changes its mind)
    grpo.py --user cooperative         the same RL with the cooperative user
    sft.py continued for the dynamic GRPO run's wall time ("SFT more", as tests/demo_study.py does)
    evaluate.py on all four, with the dynamic user (the default), on the 60 held-out tasks
Differences are paired over tasks, with a bootstrap 95% interval that resamples each seed's tasks and averages over
seeds (demo_study.bootstrap). Writes <out>/user_study.md and .json.
"""
import argparse
import json
import os

from demo_study import bootstrap, per_task, run, scores

ROWS = ["sft", "rl-dynamic", "rl-cooperative", "sft-more"]
GRPO = []  # the demo's GRPO recipe: grpo.py's defaults


def one_seed(seed, root):
    d = lambda *p: os.path.join(root, *p)
    os.makedirs(root, exist_ok=True)
    s = ["--seed", str(seed)]
    grpo = lambda out, *user: ["grpo.py", "--model", d("sft"), "--data-dir", d("data"), "--out", d(out),
                               "--overwrite", *GRPO, *user, *s]
    rec = {"seed": seed, "sec": {}}
    for name, cmd in [("synth", ["synth.py", "--data-dir", d("data"), "--user", "cooperative", *s]),
                      ("sft", ["sft.py", "--data", d("data", "sft.jsonl"), "--out", d("sft"), "--overwrite", *s]),
                      ("rl-dynamic", grpo("rl_dynamic")),
                      ("rl-cooperative", grpo("rl_cooperative", "--user", "cooperative"))]:
        rec["sec"][name] = run(cmd, d(f"{name}.log"))[0]
        print(f"seed {seed}: {name} {rec['sec'][name]} s", flush=True)
    sft_rows = [json.loads(x) for x in open(d("sft", "metrics.jsonl"))]
    n = max(1, round(rec["sec"]["rl-dynamic"] / (sum(r["sec"] for r in sft_rows) / len(sft_rows))))
    lr = sft_rows[-1]["lr"]
    rec["sft_more_steps"] = n
    rec["sec"]["sft-more"] = run(["sft.py", "--model", d("sft"), "--data", d("data", "sft.jsonl"), "--out",
                                  d("sft_more"), "--overwrite", "--steps", str(n), "--lr", str(lr), "--warmup", "0",
                                  "--eval-every", str(n), "--save-every", str(n), *s], d("sft-more.log"))[0]
    run(["evaluate.py", "--data-dir", d("data"), "--out", d("eval"), "--models", f"sft={d('sft')}",
         f"rl-dynamic={d('rl_dynamic')}", f"rl-cooperative={d('rl_cooperative')}", f"sft-more={d('sft_more')}"],
        d("evaluate.log"))
    with open(d("record.json"), "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def report(out, seeds):
    table = {s: {r: scores(per_task(os.path.join(out, f"seed{s}", "eval", f"{r}_shop.jsonl"))) for r in ROWS}
             for s in seeds}
    lines = ["| model (evaluated with the dynamic user) | " + " | ".join(f"seed {s} pass^1" for s in seeds)
             + " | mean pass^1 |", "|---|" + "---|" * (len(seeds) + 1)]
    for r in ROWS:
        p1 = [100 * sum(x[0] for x in table[s][r].values()) / len(table[s][r]) for s in seeds]
        lines.append(f"| {r} | " + " | ".join(f"{x:.1f}" for x in p1) + f" | {sum(p1) / len(p1):.1f} |")
    effects = {}
    for a, b in [("rl-dynamic", "sft-more"), ("rl-dynamic", "rl-cooperative"), ("rl-cooperative", "sft-more"),
                 ("rl-dynamic", "sft")]:
        diffs = [[100 * (table[s][a][t][0] - table[s][b][t][0]) for t in sorted(table[s][b])] for s in seeds]
        effects[f"{a} - {b}"] = [round(v, 1) for v in bootstrap(diffs)]
    lines += ["", "| difference in pass^1 (points, paired over tasks) | mean | 95% interval |", "|---|---|---|"]
    lines += [f"| {k} | {v[0]:+.1f} | [{v[1]:+.1f}, {v[2]:+.1f}] |" for k, v in effects.items()]
    md = "\n".join(lines)
    print(md)
    with open(os.path.join(out, "user_study.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "user_study.json"), "w") as f:
        json.dump({"effects": effects, "records": [json.load(open(os.path.join(out, f"seed{s}", "record.json")))
                                                   for s in seeds]}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run of every arm per seed")
    p.add_argument("--out", default="runs/user_study", help="a folder per seed, then user_study.md/.json")
    p.add_argument("--report", default=None, help="only report on the finished seeds in this folder")
    a = p.parse_args()
    if not a.report:
        for s in a.seeds:
            one_seed(s, os.path.join(a.out, f"seed{s}"))
    report(a.report or a.out, a.seeds)


if __name__ == "__main__":
    main()
