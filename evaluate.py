"""
evaluate.py: pass^k on held-out tasks, tau-bench's way, for one or more checkpoints.

    python evaluate.py                      # the demo's base, cold-start (SFT), MUA-RL (SFT+GRPO), RL-only rows
    python evaluate.py --models sft=out/sft grpo=out/grpo --k 4 --temperature 1.0   # sampled trials
    python evaluate.py --models out/grpo --tasks ../shared/tau2/retail/tasks.json \
        --db ../shared/tau2/retail/db.json --user http://localhost:8001/v1 --user-model Qwen/Qwen3-8B \
        --max-turns 30 --max-new-tokens 1024 --max-len 16384

Every test task is played k times per model. pass^k for a task with c successes out of n trials is
C(c, k) / C(n, k) (the chance that k trials drawn without replacement all succeed), averaged over tasks;
pass^1 is the average reward. results.json also holds pass@k (at least one success in k trials), which under
sampled trials (--temperature 1) bounds what RL can reach by sharpening the policy alone. The agent decodes
greedily by default (tau-bench's default), so trials differ through the user simulator: the scripted user draws
its wording from the trial's seed. Episodes whose user simulator failed are left out of n (and counted).
By default the reward also checks the information the agent had to communicate (`communicate_info`), as
tau-bench's evaluation does; --db-only scores the database alone, as training does.
Prints a markdown table (overall and per task kind) and writes every transcript to JSONL.
"""
import argparse
import json
import os
from collections import defaultdict
from math import comb

import torch

import env
from rollout import HFGenerator, VLLMGenerator, run_episodes
from sft import load_model, resolve_checkpoint


def pass_hat_k(outcomes, k):
    """outcomes: {task_id: [0/1 rewards of its trials]} -> mean over tasks of C(c,k)/C(n,k); tasks with
    fewer than k trials are skipped. None if no task has k trials."""
    vals = [comb(int(sum(rs)), k) / comb(len(rs), k) for rs in outcomes.values() if len(rs) >= k]
    return sum(vals) / len(vals) if vals else None


def pass_at_k(outcomes, k):
    """The other pass@k: the chance that at least one of k trials drawn without replacement succeeds,
    1 - C(n-c, k) / C(n, k), averaged over tasks (Chen et al. 2021's unbiased estimator). Under sampled trials
    it bounds what RL that only sharpens the policy can reach; tau-bench's pass^k is the consistency metric."""
    vals = [1 - comb(len(rs) - int(sum(rs)), k) / comb(len(rs), k) for rs in outcomes.values() if len(rs) >= k]
    return sum(vals) / len(vals) if vals else None


def evaluate_model(gen, tok, tasks, db, make_user, args):
    """Play k trials of every task; -> episodes. Trials differ through the sampling seed and the user's seed."""
    eps = []
    for trial in range(args.k):
        eps += run_episodes(gen, tok, tasks, db, make_user, max_turns=args.max_turns, max_tokens=args.max_len,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed + 1000 * trial, check_communicate=not args.db_only)
    return eps


def summarize(eps, ks):
    """-> {group: {"n": tasks, "reward": mean, "pass^k": ...}} for "all" and every task kind."""
    by = defaultdict(lambda: defaultdict(list))
    by["all"] = defaultdict(list)  # present even when every episode errored
    for e in eps:
        if not e.errored:
            by["all"][e.task_id].append(e.reward)
            by[e.kind or "-"][e.task_id].append(e.reward)
    out = {}
    for group, outcomes in by.items():
        trials = sum(len(r) for r in outcomes.values())
        out[group] = {"n": len(outcomes), "reward": sum(sum(r) for r in outcomes.values()) / trials if trials else None}
        for k in ks:
            out[group][f"pass^{k}"] = pass_hat_k(outcomes, k)
            out[group][f"pass@{k}"] = pass_at_k(outcomes, k)
    out["all"]["errored"] = sum(e.errored for e in eps)
    return out


def markdown(results, ks):
    """results: {model name: summary} -> one table, overall then per kind."""
    groups = ["all"] + sorted({g for s in results.values() for g in s} - {"all"})
    head = "| model | tasks | " + " | ".join(f"pass^{k}" for k in ks) + " |"
    lines = [head, "|" + "---|" * (2 + len(ks))]
    for g in groups:
        for name, s in results.items():
            if g in s:
                cells = [f"{100 * s[g][f'pass^{k}']:.1f}" if s[g][f"pass^{k}"] is not None else "-" for k in ks]
                label = name if g == "all" else f"{name} / {g}"
                lines.append(f"| {label} | {s[g]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v):
    return f"{v:.3f}" if v is not None else "-"


def parse_models(specs):
    """["sft=out/sft", "out/grpo"] -> {"sft": "out/sft", "grpo": "out/grpo"}"""
    out = {}
    for s in specs:
        name, _, path = s.rpartition("=")
        out[name or os.path.basename(os.path.normpath(path))] = path
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+",  # name=path; the default is the demo's four rows
                   default=["base=out/sft/init", "sft=out/sft", "mua-rl=out/grpo", "rl-only=out/grpo_rl_only"])
    p.add_argument("--data-dir", default="data")
    p.add_argument("--tasks", default=None)                 # default: <data-dir>/test_tasks.jsonl
    p.add_argument("--db", default=None)                    # default: <data-dir>/shop.json
    p.add_argument("--n-tasks", type=int, default=None)     # only the first n tasks
    p.add_argument("--k", type=int, default=4)              # trials per task
    # the agent decodes greedily, as tau-bench's run.py does by default (--temperature 0.0): pass^k then measures
    # consistency over the user's variations (the scripted user words each trial differently), not sampling luck
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--db-only", action="store_true")        # skip the communicate_info check
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)  # per agent turn; the tiny model's longest is ~40
    p.add_argument("--max-len", type=int, default=1024)      # tokens per episode (tiny: an oracle one is <600)
    p.add_argument("--user", default=None)                  # None: scripted; a model path, "smollm2", or a URL
    p.add_argument("--user-model", default=None)
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument("--out", default="out/eval")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    run(args)


def run(args):
    torch.manual_seed(args.seed)
    db = env.load_db(args.db or os.path.join(args.data_dir, "shop.json"))
    tasks = env.load_tasks(args.tasks or os.path.join(args.data_dir, "test_tasks.jsonl"))[:args.n_tasks]
    make_user = env.user_factory(args.user, args.user_model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    ks = list(range(1, args.k + 1))
    results = {}
    for name, path in parse_models(args.models).items():
        model, tok = load_model(path, device=device)
        gen = VLLMGenerator(resolve_checkpoint(path), tok) if args.backend == "vllm" else HFGenerator(model, tok)
        eps = evaluate_model(gen, tok, tasks, db, make_user, args)
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for e in eps:
                f.write(json.dumps({k: v for k, v in e.to_json().items()
                                    if k not in ("ids", "loss_mask", "logprobs")}) + "\n")
        results[name] = summarize(eps, ks)
        a = results[name]["all"]
        print(f"{name}: pass^1 {_fmt(a['pass^1'])} over {a['n']} tasks, pass@{args.k} {_fmt(a[f'pass@{args.k}'])} "
              f"(solved in at least one of {args.k} trials), {a['errored']} errored episodes", flush=True)
        del model, gen
    table = markdown(results, [k for k in (1, 2, 4, 8) if k <= args.k] or [1])
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    return results


if __name__ == "__main__":
    main()
