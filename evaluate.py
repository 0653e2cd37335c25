"""
evaluate.py: pass^k on held-out tasks, tau-bench's way, for one or more checkpoints; or BFCL v3's multi-turn
accuracy, BFCL's way (--bench bfcl).

    python evaluate.py                      # the demo's base, cold-start (SFT), MUA-RL (SFT+GRPO), RL-only rows
    python evaluate.py --models sft=out/sft grpo=out/grpo --k 4 --temperature 1.0   # sampled trials
    python evaluate.py --models out/grpo --tasks ../shared/tau2/retail/tasks.json \
        --db ../shared/tau2/retail/db.json --user http://localhost:8001/v1 --user-model Qwen/Qwen3-8B \
        --max-turns 30 --max-new-tokens 1024 --max-len 16384
    python evaluate.py --bench bfcl --models sft=out/sft --categories base miss_func --n 20   # BFCL subset
    python evaluate.py --models sft=out/sft --domain retail airline telecom    # tau2's test split, on tau2's code

Every test task is played k times per model. pass^k for a task with c successes out of n trials is
C(c, k) / C(n, k) (the chance that k trials drawn without replacement all succeed), averaged over tasks;
pass^1 is the average reward. results.json also holds pass@k (at least one success in k trials), which under
sampled trials (--temperature 1) bounds what RL can reach by sharpening the policy alone. The agent decodes
greedily by default (tau-bench's default), so trials differ through the user simulator: the scripted user draws
its wording from the trial's seed. Episodes whose user simulator failed are left out of n (and counted).
By default the reward also checks the information the agent had to communicate (`communicate_info`), as
tau-bench's evaluation does; --db-only scores the database alone, as training does. On tau2's tasks the agent's
system prompt holds tau2's domain policy (--policy, default: the policy.md beside --tasks), as tau2's agent has it.
Prints a markdown table (overall and per task kind) and writes every transcript to JSONL. An http(s) URL in
--models is an OpenAI-compatible endpoint playing the agent. --domain (tau2-bench's domains on tau2's own code,
scored by tau2's evaluator) and --bench bfcl: see the fenced sections at the bottom.
"""
import argparse
import json
import keyword
import math
import os
import re
import tempfile
from collections import defaultdict
from math import comb
from types import SimpleNamespace

import torch

import env
from rollout import (ChatAgent, TINY_BASE, add_user_args, agent_system_prompt, all_errored, check_flags,
                     errored_reasons, errored_summary, load_agent, make_user_factory, require_vllm, run_episodes,
                     short_reason, tau2_episode_kw, tau2_user_factory)


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
                   temperature, system_prompt, make_agent=None, **world_kw):
    """Play k trials of every task; -> episodes. Trials differ through the sampling seed and the user's seed.
    world_kw: a tau2 domain's run_episodes arguments (rollout.tau2_episode_kw: tools, calls, its scorer)."""
    eps = []
    for trial in range(k):
        eps += run_episodes(gen, tok, tasks, db, make_user, system_prompt=system_prompt, max_turns=max_turns,
                            max_len=max_len, max_new_tokens=max_new_tokens, temperature=temperature,
                            seed=seed + 1000 * trial, check_communicate=not db_only, make_agent=make_agent, **world_kw)
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
    if out["all"]["errored"]:
        out["all"]["errored_reasons"] = dict(errored_reasons(eps))
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


def endpoint_agents(chat, tools_of, **kw):
    """make_agent for run_episodes when an endpoint plays the agent (None without one), and the list of the
    agents it makes, in task order: their endpoint errors are read after the episodes."""
    made = []

    def make_agent(task, seed):
        made.append(ChatAgent(chat, tools_of(task), seed=seed, **kw))
        return made[-1]
    return (make_agent if chat is not None else None), made


def write_transcripts(path, eps, extras=None):
    """One JSON line per episode, without its token ids; extras: one dict per episode to add to its line."""
    with open(path, "w") as f:
        for ep, extra in zip(eps, extras or [{}] * len(eps)):
            row = {k: v for k, v in ep.to_json().items() if k not in ("ids", "loss_mask", "logprobs")}
            f.write(json.dumps({**row, **extra}) + "\n")


def write_results(out, results, table):
    print(table)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--models", nargs="+",
                   default=[f"base={TINY_BASE}", "sft=out/sft", "mua-rl=out/grpo", "rl-only=out/grpo_rl_only"],
                   help="name=path: a run folder, checkpoint, hub id or OpenAI-compatible URL (default: the demo's; "
                        "its base is the committed tests/tiny_base)")
    g.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="the agent's sampler (checkpoints)")
    g.add_argument("--vllm-gpu-memory", type=float, default=0.5, help="vLLM's share of the GPU (weights + KV cache)")
    g.add_argument("--agent-model", default=None, help="model name at an endpoint in --models (default: its name)")
    g.add_argument("--thinking", default=None, choices=["on", "off"],
                   help="Qwen3-style templates: enable_thinking on or off (default: the template's)")
    g.add_argument("--bench", default="tau2", choices=["tau2", "bfcl"],
                   help="tau2: pass^k on retail tasks; bfcl: BFCL v3's multi-turn categories")
    g = p.add_argument_group("data (tau2)")
    g.add_argument("--data-dir", default="data", help="synth.py's folder: shop.json and test_tasks.jsonl")
    g.add_argument("--tasks", default=None, help="any tau2 tasks.json / our JSONL (default: the generated test split)")
    g.add_argument("--db", default=None, help="the db.json the --tasks run on (default: <data-dir>/shop.json)")
    g.add_argument("--n-tasks", type=int, default=None, help="only the first n tasks")
    g.add_argument("--policy", dest="policy_file", default=None, help="the agent's domain policy (default: "
                   "policy.md beside --tasks, if there; 'none': the generated shop's short prompt)")
    g.add_argument("--domain", nargs="+", default=None, choices=["retail", "airline", "telecom"],
                   help="tau2-bench domains, run and scored by tau2's own code (needs requirements-tau2.txt); a "
                        "--tasks file inside a tau2 domain folder picks its domain the same way")
    g.add_argument("--split", default="test", help="with --domain: tau2's task split (train, test, base; telecom "
                                                    "also small, full)")
    g.add_argument("--judge", default=None, help="with --domain: OpenAI-compatible URL of the LLM that judges "
                                                  "tau2's NL assertions (default: reported as not judged)")
    g.add_argument("--judge-model", default=None, help="model name at the --judge endpoint")
    g = p.add_argument_group("data (bfcl)")
    g.add_argument("--categories", nargs="+", default=None, help="with or without 'multi_turn_' (default: all four)")
    g.add_argument("--n", type=int, default=None, help="only the first n entries of each category (of 200)")
    g.add_argument("--batch", type=int, default=50, help="BFCL entries played together (one run_episodes batch)")
    g = p.add_argument_group("rollout")
    g.add_argument("--k", type=int, default=4, help="trials per task (tau2; BFCL plays each entry once)")
    # the agent decodes greedily, as tau-bench's run.py does by default (--temperature 0.0): pass^k then measures
    # consistency over the user's variations (the scripted user words each trial differently), not sampling luck
    g.add_argument("--temperature", type=float, default=0.0, help="the agent's sampling temperature (0: greedy)")
    g.add_argument("--db-only", action="store_true", help="skip the communicate_info check (training's reward)")
    g.add_argument("--max-turns", type=int, default=None,
                   help="agent turns per episode (default 16; BFCL: 21 per user turn, past BFCL's step limit)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per agent turn (the tiny model's longest ~40)")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per episode (tiny: an oracle one is <600)")
    g.add_argument("--seed", type=int, default=1234, help="trial t plays with seed + 1000 t")
    add_user_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results.json, results.md, a transcript JSONL per model (default: "
                                                "out/eval, out/eval_bfcl)")
    ns = p.parse_args(argv)
    check_flags(p, ns, [  # checked up front: one line naming the flag and what it may be
            ("--k", ns.k >= 1, ">= 1"), ("--temperature", ns.temperature >= 0, ">= 0 (0: greedy)"),
            ("--n-tasks", ns.n_tasks is None or ns.n_tasks >= 1, ">= 1"),
            ("--max-turns", ns.max_turns is None or ns.max_turns >= 1, ">= 1"),
            ("--max-new-tokens", ns.max_new_tokens >= 1, ">= 1"), ("--max-len", ns.max_len >= 2, ">= 2"),
            ("--llm-concurrency", ns.llm_concurrency >= 1, ">= 1"), ("--llm-deadline", ns.llm_deadline > 0, "> 0")])
    a = vars(ns)
    bench, bfcl_kw = a.pop("bench"), {k: a.pop(k) for k in ("categories", "n", "batch")}
    tau2_kw = {k: a.pop(k) for k in ("domain", "split", "judge", "judge_model")}
    tasks_domain = env.tau2_domain_of(a["tasks"])
    # airline and telecom tasks run on tau2's code (only there); retail's run there when they are the installed
    # tau2's own, else on env.py's world, which follows the newer tau2 (../shared: get_item_details) and needs no tau2
    own = tasks_domain == "retail" and env.has_tau2() and env.is_installed_tau2_data(a["tasks"])
    if bench == "tau2" and (tau2_kw["domain"] or tasks_domain and (tasks_domain != "retail" or own)):
        tau2_kw["domain"] = tau2_kw["domain"] or [tasks_domain]
        drop = ("data_dir", "policy_file", "backend")
        return run_tau2(**tau2_kw, backend=a["backend"], **{k: v for k, v in a.items() if k not in drop})
    if bench == "bfcl":
        shared = ("models", "backend", "vllm_gpu_memory", "agent_model", "thinking", "temperature", "max_turns",
                  "max_new_tokens", "max_len", "seed", "out", "llm_concurrency", "llm_deadline")
        return run_bfcl(**bfcl_kw, **{k: a[k] for k in shared})
    return run(**a)


def run(*, models, backend, data_dir, tasks, db, n_tasks, k, temperature, db_only, max_turns, max_new_tokens,
        max_len, seed, user, user_model, user_guidelines, out, agent_model=None, policy_file=None, thinking=None,
        llm_concurrency=64, llm_deadline=300.0, vllm_gpu_memory=0.5):
    """Evaluate every model on the same tasks and users; print and write the table. -> results dict."""
    if backend == "vllm":
        require_vllm()
    out, max_turns = out or "out/eval", max_turns or 16
    torch.manual_seed(seed)
    shop = env.load_db(db or os.path.join(data_dir, "shop.json"))
    tasks_path = tasks or os.path.join(data_dir, "test_tasks.jsonl")
    test = env.load_tasks(tasks_path)[:n_tasks]
    if not test:
        raise SystemExit(f"evaluate.py: no tasks in {tasks_path}")
    make_user = make_user_factory(user, user_model, user_guidelines or env.guidelines_beside(tasks),
                                  concurrency=llm_concurrency, deadline=llm_deadline)
    system_prompt = agent_system_prompt(policy_file, tasks)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(out, exist_ok=True)
    ks = list(range(1, k + 1))
    results, every = {}, []  # every: each model's episodes, lightened: a run that scored nothing must not exit 0
    for name, path in parse_models(models).items():
        gen, tok, chat = load_agent(path, backend=backend, endpoint_model=agent_model or name, device=device,
                                    thinking=thinking, concurrency=llm_concurrency, deadline=llm_deadline,
                                    vllm_gpu_memory=vllm_gpu_memory, max_model_len=max_len + max_new_tokens, seed=seed)
        make_agent, agents = endpoint_agents(chat, lambda task: env.TOOL_SCHEMAS, deadline=4 * llm_deadline,
                                             max_new_tokens=max_new_tokens, temperature=temperature)
        eps = evaluate_model(gen, tok, test, shop, make_user, k=k, seed=seed, db_only=db_only, max_turns=max_turns,
                             max_len=max_len, max_new_tokens=max_new_tokens, temperature=temperature,
                             system_prompt=system_prompt, make_agent=make_agent)
        for ep, agent in zip(eps, agents):  # an endpoint that failed says nothing about the model: left out
            if agent.error:
                ep.errored, ep.end_reason, ep.error = True, "agent_error", agent.error
        write_transcripts(os.path.join(out, f"{name}.jsonl"), eps)
        results[name] = summarize(eps, ks)
        a = results[name]["all"]
        print(f"{name}: pass^1 {_fmt(a['pass^1'])} over {a['n']} tasks, pass@{k} {_fmt(a[f'pass@{k}'])} "
              f"(solved in at least one of {k} trials), {a['errored']} errored episodes", flush=True)
        if a["errored"]:
            print(f"  {name}: {errored_summary(eps)}", flush=True)
        every += [SimpleNamespace(errored=e.errored, error=e.error, end_reason=e.end_reason) for e in eps]
        close(gen)
    write_results(out, results, markdown(results, [n for n in (1, 2, 4, 8) if n <= k] or [1]))
    if all_errored(every):
        raise SystemExit(f"evaluate.py: {all_errored(every)}; nothing was scored (transcripts in {out})")
    return results


# ----------------------------------------------------------------------------------------------------
# tau2-bench domains on tau2's own code (--domain; requirements-tau2.txt says how to install tau2): each episode
# plays in a fresh tau2 environment (env.Tau2Domain), the user's own tool calls included (telecom), and is scored by
# tau2's evaluator on the task's reward basis. pass^k per domain with a 95% bootstrap interval over tasks; telecom
# also shows the paper's TCR (the fraction of the reward basis' criteria met). Without --user the user is the
# gold replay of the task's user side (env.GoldUser): no LLM needed, but no real customer either.

def bootstrap(outcomes, k, n=1000, seed=0):
    """95% interval of pass^k over tasks: tasks resampled with replacement n times. -> (low, high) or None."""
    per = [comb(int(sum(rs)), k) / comb(len(rs), k) for rs in outcomes.values() if len(rs) >= k]
    if not per:
        return None
    rng = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(per), (n, len(per)), generator=rng)
    means = torch.tensor(per, dtype=torch.float64)[idx].mean(1).sort().values
    return float(means[int(0.025 * n)]), float(means[min(n - 1, int(0.975 * n))])


def summarize_tau2(eps, ks, domain):
    """summarize's "all" row plus 95% intervals, TCR, NL-assertion counts and which world scored the episodes."""
    s = summarize(eps, ks)["all"]
    outcomes = defaultdict(list)
    for e in eps:
        if not e.errored:
            outcomes[e.task_id].append(e.reward)
    for k in ks:
        s[f"pass^{k}_ci95"] = bootstrap(outcomes, k)
    scored = [e.reward_info for e in eps if not e.errored and e.reward_info]
    met, total = sum(r.get("met", 0) for r in scored), sum(r.get("criteria", 0) for r in scored)
    s["tcr"] = met / total if total else None
    nl = [r for r in scored if r.get("nl_assertions")]
    s["nl_assertions"] = {"episodes": len(nl), "judged": sum(r.get("nl_met") is not None for r in nl),
                          "met": sum(all(r["nl_met"]) for r in nl if r.get("nl_met") is not None)}
    s["score_errors"] = sum("error" in r for r in scored)
    s["world"] = f"tau2 {domain.version} (tau2's own code: environment and evaluator)"
    return s


def markdown_tau2(results, ks):
    """results: {model: {domain: summary}} -> one table: pass^k [95% interval] per domain, telecom's TCR."""
    pct = lambda v: f"{100 * v:.1f}" if v is not None else "-"  # noqa: E731
    head = "| model | domain | tasks | " + " | ".join(f"pass^{k} [95% CI]" for k in ks) + " | TCR | NL assertions |"
    lines = [head, "|" + "---|" * (5 + len(ks))]
    for name, per in results.items():
        for dom, s in per.items():
            cells = [f"{pct(s[f'pass^{k}'])} [{', '.join(map(pct, s[f'pass^{k}_ci95'] or (None, None)))}]"
                     for k in ks]
            nl = s["nl_assertions"]
            nl_text = (f"{nl['judged']} of {nl['episodes']} episodes judged, {nl['met']} met" if nl["episodes"]
                       else "none")
            tcr = pct(s["tcr"]) if dom == "telecom" else "-"
            lines.append(f"| {name} | {dom} | {s['n']} | " + " | ".join(cells) + f" | {tcr} | {nl_text} |")
    return "\n".join(lines)


def run_tau2(*, models, domain, split, judge, judge_model, backend, tasks, db, n_tasks, k, temperature, db_only,
             max_turns, max_new_tokens, max_len, seed, user, user_model, user_guidelines, out, agent_model=None,
             thinking=None, llm_concurrency=64, llm_deadline=300.0, vllm_gpu_memory=0.5):
    """Every model on every domain's split, on tau2's code; print and write the tables. -> results dict."""
    if backend == "vllm":
        require_vllm()
    if judge and not judge_model:
        raise SystemExit("evaluate.py: --judge needs --judge-model")
    out, max_turns = out or "out/eval_tau2", max_turns or 30
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(out, exist_ok=True)
    ks = list(range(1, k + 1))
    worlds = {}
    for name in domain:  # a --tasks file replaces the split (and --db the agent's database) of its own domain
        d = env.Tau2Domain(name, db=db if tasks else None)
        worlds[name] = (d, d.tasks(split, path=tasks)[:n_tasks])
        if not worlds[name][1]:
            raise SystemExit(f"evaluate.py: no {name} tasks in split {split!r}")
    results = {}
    for name, path in parse_models(models).items():
        gen, tok, chat = load_agent(path, backend=backend, endpoint_model=agent_model or name, device=device,
                                    thinking=thinking, concurrency=llm_concurrency, deadline=llm_deadline,
                                    vllm_gpu_memory=vllm_gpu_memory)
        results[name] = {}
        for dom, (d, test) in worlds.items():
            make_user = tau2_user_factory(d, user, user_model, user_guidelines, concurrency=llm_concurrency,
                                          deadline=llm_deadline)
            make_agent, agents = endpoint_agents(chat, lambda task: d.tools, deadline=4 * llm_deadline,
                                                 max_new_tokens=max_new_tokens, temperature=temperature)
            world_kw = tau2_episode_kw(d, "db" if db_only else "task", judge=(judge, judge_model) if judge else None)
            eps = evaluate_model(gen, tok, test, world_kw.pop("db"), make_user, k=k, seed=seed, db_only=db_only,
                                 max_turns=max_turns, max_len=max_len, max_new_tokens=max_new_tokens,
                                 temperature=temperature, make_agent=make_agent, **world_kw)
            for ep, agent in zip(eps, agents):  # an endpoint that failed says nothing about the model: left out
                if agent.error:
                    ep.errored, ep.end_reason, ep.error = True, "agent_error", agent.error
            write_transcripts(os.path.join(out, f"{name}_{dom}.jsonl"), eps)
            s = results[name][dom] = summarize_tau2(eps, ks, d)
            print(f"{name} / {dom}: pass^1 {_fmt(s['pass^1'])} over {s['n']} tasks ({tasks or split + ' split'}), "
                  f"{s['errored']} errored episodes; {s['world']}", flush=True)
        del gen
    write_results(out, results, markdown_tau2(results, [n for n in (1, 2, 3, 4) if n <= k]))
    return results


# ----------------------------------------------------------------------------------------------------
# BFCL v3 multi-turn (--bench bfcl; `pip install --no-deps -r requirements-bfcl.txt`). Each entry is one episode
# of rollout.run_episodes: a replaying user says the entry's user turns in order, the tools are the entry's
# function docs as JSON-schema tools, and calls run in bfcl-eval's own backends. A turn lasts until the agent
# answers without a tool call. Each turn's calls, read back from the transcript, then go to bfcl-eval's own
# multi_turn_checker. Accuracy is BFCL's: entries passed / entries, and the unweighted mean of the four categories.
# Safety: bfcl-eval runs calls with eval() of call strings; ours are built from parsed JSON only (a name among the
# entry's functions, identifier argument names, repr() of JSON values). Model text never reaches eval.

BFCL_CATEGORIES = ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"]
BFCL_INSTALL = "pip install --no-deps -r requirements-bfcl.txt"
_bfcl = {}


def bfcl():
    """bfcl-eval's pieces we use, imported once. bfcl_eval.utils creates folders under BFCL_PROJECT_ROOT when
    imported (its default is beside the installed package), so it gets a temp folder of ours unless set."""
    if not _bfcl:
        os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(tempfile.gettempdir(), "mua_rl_bfcl"))
        try:
            from bfcl_eval import utils
            from bfcl_eval.constants import default_prompts, type_mappings
            from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
        except ImportError as e:
            raise SystemExit(f"--bench bfcl needs bfcl-eval ({e.name or e} is missing): {BFCL_INSTALL}") from None
        _bfcl.update(utils=utils, prompts=default_prompts, types=type_mappings.GORILLA_TO_OPENAPI,
                     checker=multi_turn_checker.multi_turn_checker, exec_utils=multi_turn_utils)
    return _bfcl


def bfcl_categories(names):
    """--categories ("base" or "multi_turn_base") -> bfcl-eval's names; an unknown one lists the valid ones."""
    out = []
    for c in names or BFCL_CATEGORIES:
        full = c if c.startswith("multi_turn_") else f"multi_turn_{c}"
        if full not in BFCL_CATEGORIES:
            raise SystemExit(f"unknown BFCL category {c!r}; valid: {', '.join(BFCL_CATEGORIES)}")
        out.append(full)
    return out


def bfcl_entries(categories, n=None):
    """The first n entries of each category as bfcl-eval loads them (load_dataset_entry fills "function" and
    moves miss_func's held-out docs to "missed_function"), each with its gold answer and its category."""
    utils, entries = bfcl()["utils"], []
    for c in categories:
        for e, gold in zip(utils.load_dataset_entry(c)[:n], utils.load_ground_truth_entry(c)[:n]):
            assert e["id"] == gold["id"], (e["id"], gold["id"])
            entries.append({**e, "category": c, "ground_truth": gold["ground_truth"]})
    return entries


def bfcl_tool(doc):
    """A BFCL function doc -> an OpenAI-style tool. BFCL's types ("dict", "float", "tuple", "any", ...) become
    JSON-schema types by bfcl-eval's own map; the doc's "response" schema describes no argument and is left out."""
    types = bfcl()["types"]

    def retype(node):
        if isinstance(node, list):
            return [retype(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: types.get(v, "string") if k == "type" and isinstance(v, str) else retype(v) for k, v in node.items()}
    return {"type": "function", "function": {"name": doc["name"], "description": doc["description"],
                                             "parameters": retype(doc["parameters"])}}


class BFCLWorld:
    """One entry's episode state, run_episodes' per-episode `db`: the entry, its tool schemas, its replaying user
    (whose turn says which held-out docs are back), and the name bfcl-eval keeps its backend instances under."""

    def __init__(self, entry, run_name, fc=False):
        self.entry, self.run_name, self.fc = entry, run_name, fc
        self.shown = [bfcl_tool(d) for d in entry["function"]]
        held = entry.get("missed_function", {})
        self.held = {int(t): [bfcl_tool(d) for d in docs] for t, docs in held.items()}
        # any of the entry's functions runs, held-out ones too, as in BFCL (which runs any method of the entry's
        # classes); miss_func_49's gold calls `tail` two turns before its doc comes back
        self.names = {d["name"] for d in entry["function"]} | {d["name"] for ds in held.values() for d in ds}
        self.user = env.ReplayUser(self.user_turns())

    def user_turns(self):
        """The entry's user turns. Where miss_func's held-out functions come back the data has no message: BFCL's
        own stands in, with the docs in it for a local model (its prompting handlers' wording)."""
        p, turns = bfcl()["prompts"], []
        for t, msgs in enumerate(self.entry["question"]):
            if msgs:
                turns.append("\n".join(m["content"] for m in msgs))
            elif self.fc:
                turns.append(p.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC)
            else:
                turns.append(p.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                    functions=json.dumps(self.held[t])))
        return turns

    def tools(self):
        """The schemas of the moment: held-out docs join at their turn for an endpoint (BFCL's FC mode). A local
        model keeps its first ones (a new system turn would change the prompt's start, not extend it)."""
        back = [s for t, ss in sorted(self.held.items()) if t <= self.user.turn for s in ss] if self.fc else []
        return self.shown + back


def _is_json(v):
    """JSON data, of exactly the built-in types (no subclass with its own repr): repr() writes a Python literal."""
    if type(v) is list:
        return all(map(_is_json, v))
    if type(v) is dict:
        return all(type(k) is str and _is_json(x) for k, x in v.items())
    return v is None or type(v) in (str, bool, int) or (type(v) is float and math.isfinite(v))


def call_string(name, args, names):
    """A parsed tool call -> the string bfcl-eval evaluates, 'name(arg=repr(value), ...)'. Raises ValueError
    unless the name is one of the entry's functions, the arguments a JSON object with identifier names."""
    if name not in names:
        raise ValueError(f"unknown function {name!r}; the functions are {', '.join(sorted(names))}")
    if not isinstance(args, dict):
        raise ValueError("the arguments must be a JSON object")
    for k, v in args.items():
        if not k.isidentifier() or keyword.iskeyword(k):
            raise ValueError(f"{k!r} is not a valid argument name")
        if not _is_json(v):
            raise ValueError(f"argument {k!r} is not JSON data")
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def bfcl_call(world, name, args):
    """run_episodes' call_tool: one call, run in the entry's bfcl-eval backends. -> (result text, is_error)."""
    try:
        call = call_string(name, args, world.names)
    except ValueError as e:
        return f"Error: {e}", True
    e = world.entry
    out, _ = bfcl()["exec_utils"].execute_multi_turn_func_call(
        [call], e["initial_config"], e["involved_classes"], world.run_name, e["id"],
        long_context="long_context" in e["id"], is_evaL_run=False)
    return out[0], out[0].startswith("Error during execution")


def bfcl_decode(messages, world):
    """A transcript -> BFCL's decoded model result: per user turn, per assistant message that made valid calls
    (a step), the list of call strings it ran. Steps past BFCL's limit end the entry at that turn (BFCL's force
    quit: fewer turns than the gold fail)."""
    turns = []
    for m in messages:
        if m["role"] == "user":
            turns.append([])
        elif m["role"] == "assistant" and turns:
            step = []
            for c in m.get("tool_calls", []):
                try:
                    step.append(call_string(c["function"]["name"], c["function"]["arguments"], world.names))
                except ValueError:
                    pass  # answered with an error, never run: BFCL would not have run it either
            if step:
                turns[-1].append(step)
    turns = turns[:len(world.entry["question"])]  # the user's closing ###STOP### is no turn
    limit = bfcl()["prompts"].MAXIMUM_STEP_LIMIT
    for t, steps in enumerate(turns):
        if len(steps) > limit:
            return turns[:t] + [steps[:limit + 1]]
    return turns


def bfcl_reset(run_name):
    """Drop the backend instances bfcl-eval keeps in its module globals, keyed by model name and entry id (the
    rollout's, the checker's and the gold's), so another run of the same entries starts from the initial state."""
    g = vars(bfcl()["exec_utils"])
    for key in [k for k in g if k.startswith(run_name + "_") and k.endswith("_instance")]:
        del g[key]


def bfcl_play(gen, tok, entries, *, run_name, make_agent=None, fc=False, batch=50, max_turns, max_len,
              max_new_tokens, temperature, seed):
    """Play every entry once through run_episodes, `batch` entries at a time. -> (episodes, worlds)."""
    bfcl_reset(run_name)
    worlds = [BFCLWorld(e, run_name, fc) for e in entries]
    tasks = [{"id": e["id"], "kind": e["category"], "world": w} for e, w in zip(entries, worlds)]
    eps = []
    for i in range(0, len(tasks), batch):
        # no system prompt: BFCL's FC handlers send none, the template's tool preamble is the instruction
        eps += run_episodes(gen, tok, tasks[i:i + batch], lambda t: t["world"], lambda t, s: t["world"].user,
                            tools=lambda t: t["world"].tools(), system_prompt=None, call_tool=bfcl_call,
                            make_agent=make_agent, score=False, max_turns=max_turns, max_len=max_len,
                            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
    return eps, worlds


def bfcl_score(eps, worlds, run_name):
    """bfcl-eval's multi_turn_checker on every episode. -> one dict per episode: valid, error type and message,
    and the decoded calls. A result with fewer turns than the gold fails first, as in bfcl-eval's runner."""
    checker, rows = bfcl()["checker"], []  # bfcl_play cleared this name's instances, the checker's too
    for ep, w in zip(eps, worlds):
        e, decoded = w.entry, bfcl_decode(ep.messages, w)
        if len(decoded) != len(e["ground_truth"]):
            res = {"valid": False, "error_type": "multi_turn:force_terminated",
                   "error_message": f"{len(decoded)} turns played of {len(e['ground_truth'])}"}
        else:
            res = checker(decoded, e["ground_truth"], e, e["category"], run_name)
        rows.append({"valid": bool(res["valid"]), "error_type": res.get("error_type"),
                     "error_message": res.get("error_message"), "decoded": decoded})
    bfcl_reset(run_name)
    return rows


def bfcl_summary(eps, rows, categories):
    """-> {category: {"n", "correct", "accuracy"}, "overall": {"accuracy"}}; the overall is the unweighted
    mean of the four categories (None unless all four ran, where BFCL shows N/A)."""
    out = {}
    for c in categories:
        hits = [r["valid"] for ep, r in zip(eps, rows) if ep.kind == c]
        out[c] = {"n": len(hits), "correct": sum(hits), "accuracy": sum(hits) / len(hits) if hits else None}
    accs = [out[c]["accuracy"] for c in BFCL_CATEGORIES if c in out]
    full = len(accs) == len(BFCL_CATEGORIES) and None not in accs
    out["overall"] = {"accuracy": sum(accs) / len(accs) if full else None}
    return out


def bfcl_markdown(results, categories):
    head = "| model | overall | " + " | ".join(c.removeprefix("multi_turn_") for c in categories) + " |"
    lines = [head, "|" + "---|" * (2 + len(categories))]
    pct = lambda v: f"{100 * v:.1f}" if v is not None else "-"  # noqa: E731
    for name, s in results.items():
        lines.append(f"| {name} | {pct(s['overall']['accuracy'])} | "
                     + " | ".join(pct(s[c]["accuracy"]) for c in categories) + " |")
    return "\n".join(lines)


def close(gen):
    """One model's sampler done: a vLLM engine is shut down (its memory freed) before the next model's starts."""
    if hasattr(gen, "shutdown"):
        gen.shutdown()


def run_bfcl(*, models, backend, agent_model, categories, n, batch, temperature, max_turns, max_new_tokens,
             max_len, seed, out, thinking=None, llm_concurrency=64, llm_deadline=300.0, vllm_gpu_memory=0.5):
    """Every model on the chosen BFCL categories; print and write the table. -> results dict."""
    out = out or "out/eval_bfcl"
    categories = bfcl_categories(categories)
    entries = bfcl_entries(categories, n)
    # BFCL fails an entry once a turn takes more than 20 steps (bfcl_decode); until then nothing else may stop it
    max_turns = max_turns or (bfcl()["prompts"].MAXIMUM_STEP_LIMIT + 1) * max(len(e["question"]) for e in entries)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(out, exist_ok=True)
    results, failed = {}, []  # failed: each entry's endpoint error, or None
    for name, path in parse_models(models).items():
        run_name = "mua_" + re.sub(r"\W", "_", name)  # bfcl-eval keys instances by it: no spaces, no '@'
        gen, tok, chat = load_agent(path, backend=backend, endpoint_model=agent_model or name, device=device,
                                    thinking=thinking, concurrency=llm_concurrency, deadline=llm_deadline,
                                    vllm_gpu_memory=vllm_gpu_memory, max_model_len=max_len + max_new_tokens, seed=seed)
        make_agent, agents = endpoint_agents(chat, lambda task: task["world"].tools, deadline=4 * llm_deadline,
                                             max_new_tokens=max_new_tokens, temperature=temperature)
        eps, worlds = bfcl_play(gen, tok, entries, run_name=run_name, make_agent=make_agent, fc=chat is not None,
                                batch=batch, max_turns=max_turns, max_len=max_len, max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=seed)
        rows = bfcl_score(eps, worlds, run_name)
        errors = [a.error for a in agents] or [None] * len(eps)  # an endpoint's failure fails the entry, as in BFCL
        write_transcripts(os.path.join(out, f"{name}.jsonl"), eps,
                          [{"bfcl": r, "agent_error": err} for r, err in zip(rows, errors)])
        results[name] = bfcl_summary(eps, rows, categories)
        print(f"{name}: {sum(r['valid'] for r in rows)} of {len(rows)} entries passed, "
              f"{sum(e is not None for e in errors)} endpoint errors", flush=True)
        failed += errors
        close(gen)
    write_results(out, results, bfcl_markdown(results, categories))
    if failed and all(e is not None for e in failed):  # scored 0 as BFCL does, but nothing was measured
        raise SystemExit(f"evaluate.py: every entry's agent endpoint failed ({len(failed)} of {len(failed)}), the "
                         f"first because {short_reason(failed[0])}; nothing was measured (transcripts in {out})")
    return results


if __name__ == "__main__":
    main()
