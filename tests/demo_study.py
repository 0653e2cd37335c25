"""
The CPU demo, measured: the README's pipeline on seeds 0-2 from a fresh data folder each, timed stage by stage, and
RL's effect against the same compute spent on more SFT.

    python tests/demo_study.py                         # seeds 0 1 2 into runs/study (about 30 min a seed, alone)
    python tests/demo_study.py --seeds 0 --out runs/s0 # one seed
    python tests/demo_study.py --report runs/study     # only the table and the plot, from finished runs
    python tests/demo_study.py --validate runs/study   # finished runs on 100 training-side tasks a seed (1.5 min each)
    python tests/demo_study.py --sft-args "--patience 4 --steps 1500 --eval-frac 0.1" --grpo-args "--steps 30"

Per seed S, each a command line of the README's pipeline with `--seed S` (the defaults otherwise):
    synth.py; sft.py (from the committed base); grpo.py (M minutes);
    grpo.py from the base (RL only); evaluate.py (base, SFT, MUA-RL, RL-only)   <- these five are "the pipeline":
    their wall time and peak RSS
    sft.py continued from the SFT model for as many steps as M minutes buy at its measured speed ("SFT more"),
    at the learning rate of its last step (with --patience: of the step its validation chose); evaluate.py on it.
GRPO's effect is MUA-RL minus SFT (the paper's claim) and minus SFT-more (the same compute) on the held-out tasks
(greedy pass^1 and pass^4 over 4 trials): the mean over seeds, with a 95% interval from a paired bootstrap that
resamples each seed's tasks (the same tasks for both models) and averages over seeds, a second that resamples the
seeds too (how far a rerun moves it), and pass^1 per task kind.
Writes <out>/study.json, <out>/study.md and <out>/reward.png (GRPO's training reward, every seed).
--validate scores the same three models on training-side tasks neither stage trained on, their users re-drawn to be
as unseen as the test users (<seed>/data/validation): the place to compare defaults, since the held-out tasks must
not be.
Writes <out>/validation.md.
"""
import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ["base", "sft", "mua-rl", "rl-only", "sft-more"]


def run(cmd, log):
    """Run one stage; -> (wall seconds, peak RSS in GB of that process tree's largest process)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
        _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed ({status}); see {log}")
    return round(time.time() - t0, 1), round(usage.ru_maxrss / 2**20, 2)


def one_seed(seed, root, sft_args=(), grpo_args=()):
    """The pipeline and the compute-matched SFT arm for one seed, the stages' defaults changed by `sft_args` and
    `grpo_args` (flag lists). -> its record (times, RSS, steps)."""
    d = lambda *p: os.path.join(root, *p)
    os.makedirs(root, exist_ok=True)
    s = ["--seed", str(seed)]
    stages = {
        "synth": ["synth.py", "--data-dir", d("data"), *s],
        "sft": ["sft.py", *sft_args, "--data", d("data", "sft.jsonl"), "--out", d("sft"), "--overwrite", *s],
        "grpo": ["grpo.py", *grpo_args, "--model", d("sft"), "--data-dir", d("data"), "--out", d("grpo"),
                 "--overwrite", *s],
        "rl-only": ["grpo.py", *grpo_args, "--model", "tests/tiny_base", "--data-dir", d("data"), "--out",
                    d("grpo_rl_only"), "--overwrite", *s],
        "evaluate": ["evaluate.py", "--data-dir", d("data"), "--out", d("eval"), "--models",
                     "base=tests/tiny_base", f"sft={d('sft')}", f"mua-rl={d('grpo')}", f"rl-only={d('grpo_rl_only')}"],
    }
    rec = {"seed": seed, "sec": {}, "rss_gb": {}}
    for name, cmd in stages.items():
        rec["sec"][name], rec["rss_gb"][name] = run(cmd, d(f"{name}.log"))
        print(f"seed {seed}: {name} {rec['sec'][name]} s, peak RSS {rec['rss_gb'][name]} GB", flush=True)
    # the compute-matched arm: SFT continued for GRPO's wall time, at the speed SFT's own steps ran
    sft_rows = [json.loads(x) for x in open(d("sft", "metrics.jsonl"))]
    sec_per_step = sum(r["sec"] for r in sft_rows) / len(sft_rows)  # training steps alone, not validations
    n = max(1, round(rec["sec"]["grpo"] / sec_per_step))
    chosen = int(open(d("sft", "latest")).read().strip().rsplit("_", 1)[1])  # the last, or the one validation chose
    end_lr = next(r["lr"] for r in sft_rows if r["step"] == chosen)
    rec["sft_steps"], rec["sft_chosen_step"] = len(sft_rows), chosen
    rec.update(sft_sec_per_step=round(sec_per_step, 3), sft_more_steps=n, sft_more_lr=end_lr)
    more = ["sft.py", *sft_args, "--model", d("sft"), "--data", d("data", "sft.jsonl"), "--out", d("sft_more"),
            "--overwrite", "--steps", str(n), "--lr", str(end_lr), "--warmup", "0", "--eval-every", str(n),
            "--save-every", str(n), *s]
    rec["sec"]["sft-more"], rec["rss_gb"]["sft-more"] = run(more, d("sft-more.log"))
    ev = ["evaluate.py", "--data-dir", d("data"), "--out", d("eval_more"), "--models", f"sft-more={d('sft_more')}"]
    rec["sec"]["evaluate-more"], _ = run(ev, d("evaluate-more.log"))
    rec["pipeline_sec"] = sum(rec["sec"][k] for k in stages)
    rec["pipeline_rss_gb"] = max(rec["rss_gb"][k] for k in stages)
    with open(d("record.json"), "w") as f:
        json.dump(rec, f, indent=1)
    return rec


KINDS = {}  # task id -> its kind, from the transcripts read


def per_task(path):
    """A transcript JSONL -> {task_id: [rewards of its trials]} (errored episodes left out, as in evaluate.py)."""
    out = {}
    for line in open(path):
        e = json.loads(line)
        KINDS[e["task_id"]] = e.get("kind", "")
        if not e.get("errored"):
            out.setdefault(e["task_id"], []).append(float(e["reward"]))
    return out


def scores(trials):
    """{task: rewards} -> {task: (pass^1, pass^4)} with 4 trials a task: pass^4 is 1 iff all four succeeded."""
    return {t: (sum(r) / len(r), float(all(x == 1.0 for x in r))) for t, r in trials.items()}


def bootstrap(diffs, n=10000, seed=0, runs=False):
    """diffs: one list of per-task differences per seed. Resample each seed's tasks with replacement, average per
    seed, then over seeds. runs: each draw first resamples the seeds too (whole runs, with replacement), so the
    interval also carries how far a rerun of the pipeline moves the result; with few seeds it is coarse (3 seeds give
    10 distinct draws of runs). -> (mean, 2.5th percentile, 97.5th percentile)."""
    rng = random.Random(seed)
    mean = sum(sum(d) / len(d) for d in diffs) / len(diffs)
    pick = lambda: (rng.choice(diffs) for _ in diffs) if runs else diffs  # lazy: a run, then its tasks, in turn
    draws = sorted(sum(sum(rng.choice(d) for _ in d) / len(d) for d in pick()) / len(diffs) for _ in range(n))
    return mean, draws[int(0.025 * n)], draws[int(0.975 * n) - 1]


def report(out, seeds):
    recs = [json.load(open(os.path.join(out, f"seed{s}", "record.json"))) for s in seeds]
    table = {}
    for s in seeds:
        ev = lambda name, folder="eval": scores(per_task(os.path.join(out, f"seed{s}", folder, f"{name}_shop.jsonl")))
        table[s] = {r: ev(r) for r in ROWS[:4]}
        table[s]["sft-more"] = ev("sft-more", "eval_more")
    lines = ["| model | " + " | ".join(f"seed {s} pass^1 / pass^4" for s in seeds) + " | mean pass^1 | mean pass^4 |",
             "|---|" + "---|" * (len(seeds) + 2)]
    summary = {}
    for r in ROWS:
        cells, p1s, p4s = [], [], []
        for s in seeds:
            v = table[s][r].values()
            p1, p4 = 100 * sum(x[0] for x in v) / len(v), 100 * sum(x[1] for x in v) / len(v)
            cells.append(f"{p1:.1f} / {p4:.1f}")
            p1s.append(p1)
            p4s.append(p4)
        summary[r] = {"pass^1": p1s, "pass^4": p4s}
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {sum(p1s) / len(p1s):.1f} | {sum(p4s) / len(p4s):.1f} |")
    effects = differences(table, seeds)
    lines += difference_lines(effects)
    kinds = sorted({KINDS[t] for s in seeds for t in table[s]["sft"]})
    by_kind = {k: {r: 100 * sum(x[0] for s in seeds for t, x in table[s][r].items() if KINDS[t] == k)
                   / max(1, sum(KINDS[t] == k for s in seeds for t in table[s][r])) for r in ROWS} for k in kinds}
    lines += ["", "| task kind (tasks over seeds) | " + " | ".join(ROWS[1:]) + " | MUA-RL - SFT |",
              "|---|" + "---|" * len(ROWS)]
    lines += [f"| {k} ({sum(KINDS[t] == k for s in seeds for t in table[s]['sft'])}) | "
              + " | ".join(f"{v[r]:.1f}" for r in ROWS[1:]) + f" | {v['mua-rl'] - v['sft']:+.1f} |"
              for k, v in by_kind.items()]
    lines += ["", "| seed | pipeline (s) | peak RSS (GB) | SFT steps (chosen) | GRPO (s) | SFT-more steps |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['pipeline_sec']:.0f} | {r['pipeline_rss_gb']:.2f} | {r.get('sft_steps', '-')} "
              f"({r.get('sft_chosen_step', '-')}) | {r['sec']['grpo']:.0f} | {r['sft_more_steps']} |" for r in recs]
    md = "\n".join(lines)
    print(md)
    with open(os.path.join(out, "study.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump({"records": recs, "rows": summary, "effects": effects, "by_kind": by_kind}, f, indent=1)
    plot_rewards(out, seeds)


def differences(table, seeds):
    """table: seed -> model -> {task: (pass^1, pass^4)} -> {"a - b, pass^k": [mean, 95% interval over tasks (lo, hi),
    95% interval with the runs resampled too (lo, hi)]} in points: MUA-RL and SFT-more against SFT and each other."""
    effects = {}
    for a, b in [("mua-rl", "sft"), ("mua-rl", "sft-more"), ("sft-more", "sft")]:
        for k, name in ((0, "pass^1"), (1, "pass^4")):
            diffs = [[100 * (table[s][a][t][k] - table[s][b][t][k]) for t in sorted(table[s][b])] for s in seeds]
            m, lo, hi = bootstrap(diffs)
            _, rlo, rhi = bootstrap(diffs, runs=True)
            effects[f"{a} - {b}, {name}"] = [round(x, 1) for x in (m, lo, hi, rlo, rhi)]
    return effects


def difference_lines(effects):
    """differences() as a markdown table, after a blank line."""
    return ["", "| difference (points, paired over tasks) | mean | 95% interval | 95% interval, runs resampled too |",
            "|---|---|---|---|"] + [f"| {k} | {v[0]:+.1f} | [{v[1]:+.1f}, {v[2]:+.1f}] | [{v[3]:+.1f}, {v[4]:+.1f}] |"
                                    for k, v in effects.items()]


# ----------------------------------------------------------------------------------------------------
# --validate: the finished runs on the training side, on tasks neither stage trained on and users no model saw


def task_key(task):
    """What makes two tasks the same request: the user's scenario and the gold calls (not their action ids)."""
    calls = [(a["name"], a["arguments"]) for a in task["evaluation_criteria"]["actions"]]
    return json.dumps([task["user_scenario"], calls], sort_keys=True)


def validation_set(data_dir, seed, n=100):
    """n training-side tasks that are to the trained models what the held-out ones are: new tasks over the training
    users, the kinds in turn (none equal to a task of train_tasks.jsonl; the test users untouched), then the shop
    and these tasks with every id and name re-drawn by one mapping (sft.redraw_ids), so their users are as unseen as
    the test users. -> (shop path, tasks path) in <data_dir>/validation, made once."""
    sys.path.insert(0, REPO)
    import env
    import sft
    import synth
    folder = os.path.join(data_dir, "validation")  # not "val": 6413063 made uneven sets there
    shop, tasks_path = os.path.join(folder, "shop.json"), os.path.join(folder, "tasks.jsonl")
    if os.path.exists(tasks_path):
        return shop, tasks_path
    db = env.load_db(os.path.join(data_dir, "shop.json"))
    users = synth.split_users(db, random.Random(seed))["train"]  # generate_tasks' split of this seed's shop
    seen = {task_key(t) for t in env.load_tasks(os.path.join(data_dir, "train_tasks.jsonl"))}
    kinds, rng, tasks = list(synth.TASK_KINDS), random.Random(10**6 + seed), []
    while len(tasks) < n and kinds:  # the kinds in turn, as generate_tasks balances the training and held-out tasks
        kind = kinds[len(tasks) % len(kinds)]
        draws = (synth._make_task(db, db["users"][rng.choice(users)], kind, rng) for _ in range(500))
        t = next((t for t in draws if t and task_key(t) not in seen), None)
        if t is None:  # the training tasks took every request of this kind the training users can make
            kinds.remove(kind)
            continue
        seen.add(task_key(t))
        t["id"] = f"val_{len(tasks)}"
        for j, a in enumerate(t["evaluation_criteria"]["actions"]):
            a["action_id"] = f"{t['id']}_{j}"
        tasks.append(t)
    if len(tasks) < n:
        raise SystemExit(f"{data_dir}: only {len(tasks)} new training-side tasks; ask for fewer (--val-tasks)")
    new_db, tasks = sft.redraw_ids([db, tasks], random.Random(seed), keys=True, unique=True)
    if any(len(new_db[k]) != len(db[k]) for k in db):  # unique=True makes this impossible; a shop that breaks it stops
        raise SystemExit(f"{data_dir}/shop.json: re-drawing its ids merged records")
    os.makedirs(folder, exist_ok=True)
    with open(shop, "w") as f:
        json.dump(new_db, f)
    env.save_tasks(tasks, tasks_path)
    return shop, tasks_path


def validate(out, seeds, n=100):
    """Each finished seed's SFT, MUA-RL and SFT-more on its validation_set (4 greedy trials), and the paired
    differences as `report` computes them. Writes <out>/validation.md."""
    table = {}
    for s in seeds:
        d = lambda *p: os.path.join(out, f"seed{s}", *p)
        ev = d("eval_validation")  # not "eval_val": 6413063's scores on its uneven sets
        if not os.path.exists(os.path.join(ev, "results.json")):
            shop, tasks = validation_set(d("data"), s, n)
            run(["evaluate.py", "--data-dir", d("data"), "--db", shop, "--tasks", tasks, "--k", "4", "--out", ev,
                 "--models", f"sft={d('sft')}", f"mua-rl={d('grpo')}", f"sft-more={d('sft_more')}"],
                d("evaluate-val.log"))
        table[s] = {r: scores(per_task(os.path.join(ev, f"{r}_shop.jsonl"))) for r in ("sft", "mua-rl", "sft-more")}
    lines = ["| model | " + " | ".join(f"seed {s} pass^1" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    lines += [f"| {r} | " + " | ".join(f"{100 * sum(x[0] for x in table[s][r].values()) / len(table[s][r]):.1f}"
                                     for s in seeds) + " |" for r in ("sft", "mua-rl", "sft-more")]
    lines += difference_lines(differences(table, seeds))
    print("\n".join(lines))
    with open(os.path.join(out, "validation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot_rewards(out, seeds):
    try:
        import matplotlib
    except ImportError:  # optional: the tables above are already written
        print("no reward plot: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for s in seeds:
        rows = [json.loads(x) for x in open(os.path.join(out, f"seed{s}", "grpo", "metrics.jsonl"))]
        ax.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], color=f"C{s}", label=f"seed {s}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "reward.png"), dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one full pipeline per seed")
    p.add_argument("--out", default="runs/study", help="a folder per seed, then study.md/.json and reward.png")
    p.add_argument("--report", default=None, help="only report on the finished seeds in this folder")
    p.add_argument("--sft-args", default="", help="flags for every sft.py run, before the study's own (which win), "
                   "e.g. \"--patience 4 --steps 1500 --eval-frac 0.1\"")
    p.add_argument("--grpo-args", default="", help="flags for both grpo.py runs, e.g. \"--steps 60\"")
    p.add_argument("--validate", default=None, help="only score the finished seeds in this folder on training-side "
                   "tasks neither stage trained on, their users re-drawn (validation_set): where to choose defaults")
    p.add_argument("--val-tasks", type=int, default=100, help="validation tasks per seed (--validate)")
    a = p.parse_args()
    if a.validate:
        return validate(a.validate, a.seeds, a.val_tasks)
    if not a.report:
        for s in a.seeds:
            one_seed(s, os.path.join(a.out, f"seed{s}"), shlex.split(a.sft_args), shlex.split(a.grpo_args))
    report(a.report or a.out, a.seeds)


if __name__ == "__main__":
    main()
