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
from rollout import (HFGenerator, VLLMGenerator, load_model, make_user_factory, require_vllm, resolve_checkpoint,
                     run_episodes)


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


def evaluate_model(gen, tok, tasks, db, make_user, *, k, seed, db_only, max_turns, max_len, max_new_tokens,
                   temperature):
    """Play k trials of every task; -> episodes. Trials differ through the sampling seed and the user's seed."""
    eps = []
    for trial in range(k):
        eps += run_episodes(gen, tok, tasks, db, make_user, max_turns=max_turns, max_tokens=max_len,
                            max_new_tokens=max_new_tokens, temperature=temperature,
                            seed=seed + 1000 * trial, check_communicate=not db_only)
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--models", nargs="+",
                   default=["base=out/sft/init", "sft=out/sft", "mua-rl=out/grpo", "rl-only=out/grpo_rl_only"],
                   help="name=path (a run folder, a checkpoint or a hub id); default: the demo's four rows")
    g.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="the agent's sampler")
    g.add_argument("--vllm-gpu-memory", type=float, default=0.5,
                   help="vLLM's share of the GPU (its weights + KV cache)")
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default="data", help="synth.py's folder: shop.json and test_tasks.jsonl")
    g.add_argument("--tasks", default=None, help="any tau2 tasks.json / our JSONL (default: the generated test split)")
    g.add_argument("--db", default=None, help="the db.json the --tasks run on (default: <data-dir>/shop.json)")
    g.add_argument("--n-tasks", type=int, default=None, help="only the first n tasks")
    g = p.add_argument_group("rollout")
    g.add_argument("--k", type=int, default=4, help="trials per task")
    # the agent decodes greedily, as tau-bench's run.py does by default (--temperature 0.0): pass^k then measures
    # consistency over the user's variations (the scripted user words each trial differently), not sampling luck
    g.add_argument("--temperature", type=float, default=0.0, help="the agent's sampling temperature (0: greedy)")
    g.add_argument("--db-only", action="store_true", help="skip the communicate_info check (training's reward)")
    g.add_argument("--max-turns", type=int, default=16, help="agent turns per episode")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per agent turn (the tiny model's longest ~40)")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per episode (tiny: an oracle one is <600)")
    g.add_argument("--seed", type=int, default=1234, help="trial t plays with seed + 1000 t")
    g = p.add_argument_group("user")
    g.add_argument("--user", default=None, help="None: scripted; a model path, 'smollm2', or an OpenAI URL")
    g.add_argument("--user-model", default=None, help="model name at the --user endpoint")
    g.add_argument("--user-guidelines", default=None,
                   help="the LLM user's guidelines (default: tau2's beside --tasks, else env.py's fallback)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="out/eval", help="results.json, results.md and a transcript JSONL per model")
    return run(**vars(p.parse_args(argv)))


def run(*, models, backend, vllm_gpu_memory, data_dir, tasks, db, n_tasks, k, temperature, db_only, max_turns,
        max_new_tokens, max_len, seed, user, user_model, user_guidelines, out):
    """Evaluate every model on the same tasks and users; print and write the table. -> results dict."""
    if backend == "vllm":
        require_vllm()
    torch.manual_seed(seed)
    shop = env.load_db(db or os.path.join(data_dir, "shop.json"))
    test = env.load_tasks(tasks or os.path.join(data_dir, "test_tasks.jsonl"))[:n_tasks]
    make_user = make_user_factory(user, user_model, user_guidelines or env.guidelines_beside(tasks))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(out, exist_ok=True)
    ks = list(range(1, k + 1))
    results = {}
    for name, path in parse_models(models).items():
        model, tok = load_model(path, device=device if backend == "hf" else "cpu")  # vLLM loads its own copy
        gen = (VLLMGenerator(resolve_checkpoint(path), tok, gpu_memory_utilization=vllm_gpu_memory)
               if backend == "vllm" else HFGenerator(model, tok))
        eps = evaluate_model(gen, tok, test, shop, make_user, k=k, seed=seed, db_only=db_only, max_turns=max_turns,
                             max_len=max_len, max_new_tokens=max_new_tokens, temperature=temperature)
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for e in eps:
                f.write(json.dumps({key: v for key, v in e.to_json().items()
                                    if key not in ("ids", "loss_mask", "logprobs")}) + "\n")
        results[name] = summarize(eps, ks)
        a = results[name]["all"]
        print(f"{name}: pass^1 {_fmt(a['pass^1'])} over {a['n']} tasks, pass@{k} {_fmt(a[f'pass@{k}'])} "
              f"(solved in at least one of {k} trials), {a['errored']} errored episodes", flush=True)
        del model, gen
    table = markdown(results, [n for n in (1, 2, 4, 8) if n <= k] or [1])
    print(table)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    return results


if __name__ == "__main__":
    main()
