"""
grpo.py: MUA-RL's reinforcement learning. The policy plays whole conversations with a simulated user, calling real
tools, and learns from the 0/1 task reward alone with GRPO (no value model).

    python grpo.py --model out/sft                       # CPU demo: SFT model, scripted user (the default)
    python grpo.py --model tests/tiny_base --out out/grpo_rl_only  # RL only, from the base (no cold start)
    python grpo.py --model out/sft --user smollm2 --steps 3        # SmolLM2-135M-Instruct plays the user
    python grpo.py --model out/sft --domain airline --split train   # a tau2 domain on tau2's code (gold-replay user)
    python grpo.py --model out/sft --tau1 retail --user smollm2      # tau-bench v1 retail's 500 train tasks

GPU recipe of the paper (Qwen3-8B after cold-start SFT; 8 x 80 GB; a vLLM server elsewhere for the user). FSDP2
with activation checkpointing; each rank's vLLM engine takes 70% of its GPU while it samples and sleeps while the
policy trains (rollout.print_memory_plan: 68.5 GiB peak per GPU; the run checks its own plan before loading):
    torchrun --nproc_per_node 8 grpo.py --model out/sft_qwen3_8b --backend vllm --group 8 --batch-tasks 32 \
        --lr 1e-6 --clip 0.2 --beta 0.001 --max-turns 30 --max-new-tokens 1024 --max-len 16384 \
        --micro-batch 1 --fsdp on --activation-checkpointing on --vllm-gpu-memory 0.7 \
        --user http://localhost:8001/v1 --user-model Qwen/Qwen3-8B

One step (grpo_step, the first function below): sample B train tasks; play G episodes of each (temperature 1.0) with
the user in the loop; the world scores each 0/1 (--reward-basis task, the default: what evaluate.py scores, the
database check and the information the agent had to say; db: the database check alone, the paper's); advantage =
(r - group mean) / (group std + 1e-4); PPO-clipped policy loss against the log-probs frozen at rollout time, summed
over the policy's own tokens and divided by their number in the global mini-batch; optional k3 KL to a frozen
reference (beta 0: no reference model is loaded). Groups whose rewards are all equal carry no gradient: they are
counted, logged, and (--drop-zero-spread) replaced by fresh groups; a step in which every group is so skips the
update.

A reading path through the method, in this order:
  1. grpo.py: grpo_step, collect, group_advantages, ppo, update, policy_loss (the next ~160 lines). train(), below
     them, is the loop around the step: setup, the steps, checkpoints.
  2. rollout.py: run_episodes, the multi-turn loop (generate a turn; run its tool calls on the episode's own state,
     or hand its text to the user), and TokenAgent, the policy as token-in, token-out agent.
  3. env.py: World (the contract), Shop (the tools and the reward: gold actions replayed, database hashes compared)
     and ScriptedUser, the simulated customer.

What is simplified, and why:
1. No value model, no reward model: the reward is the task's 0/1 check, and the group of G rollouts of one task
   is the baseline.
2. Rollouts and training share one process (and one GPU): the transformers sampler reads the live weights, and the
   vLLM engine gets them pushed (bf16, LoRA merged) after every update. No separate inference service.
3. One optimizer step per batch by default (--ppo-epochs 1 --mini-batches 1), so the PPO ratio starts at 1 up to
   the difference between the sampler's log-probs and the trainer's (a KV-cached or a bf16 vLLM forward against
   the training forward; tests/gpu_check.py measures it), and clipping only matters when you ask for more.
4. Tasks are drawn uniformly, as in the paper. --task-sampling spread (a curriculum by running success) and
   --drop-zero-spread (DAPO's dynamic sampling) come from later work and are off by default.
"""
import argparse
import collections
import copy
import json
import os
import random
import time

import torch
from tqdm import tqdm

import env
from rollout import (AdapterOff, HFGenerator, ModelSetup, Ranks, TokenAgent, VLLMGenerator, add_scale_args,
                     add_user_args, autocast, check_flags, claim_or_stop, clip_grad, cpu_threads, errored_reasons,
                     leave_ranks, load_model, load_optimizer_state, load_train_state, logprobs_chunked, open_metrics,
                     pad_batch, require_vllm, resolve_checkpoint, run_episodes, save_checkpoint, set_thinking,
                     setup_distributed, unwrap, user_backend)


# ----------------------------------------------------------------------------------------------------
# one GRPO step: the whole algorithm. Read this first; collect, ppo and update come right after it.

def grpo_step(policy, ref, opt, agent, world, tasks, *, step, seed, batch_tasks, group, reward_basis, mean_only,
              drop_zero_spread, update_kw, ranks, weights=None, keys=None):
    """One GRPO step: sample tasks, play them with the user in the loop, score them, group-normalised advantages,
    PPO-clip updates. `update_kw` goes to ppo; `weights` (one per task, or None: uniform) to the task draw. -> the
    step's metrics (one JSONL line) and, under "tally", the step's global [successes, rollouts] per task key
    (task_key; `keys` as in train), which train() adds to its running tally for --task-sampling spread."""
    t0 = time.time()
    # 1-3. this rank's share of the B tasks, G episodes of each with the user in the loop (tools run as they are
    # called), each scored 0/1 by the world on the reward basis it trains on
    episodes, zero_spread, groups, dropped = collect(agent, world, tasks, step=step, seed=seed, group=group,
                                                     batch_tasks=batch_tasks, reward_basis=reward_basis,
                                                     drop_zero_spread=drop_zero_spread, weights=weights, ranks=ranks)
    t1 = time.time()
    # 4. group-normalised advantages: (r - mean) / std within each task's G episodes. A failed user simulator says
    # nothing about the policy: its episode stays out of its group's mean and std, and out of the update
    advs = group_advantages([e.reward for e in episodes], group, mean_only, valid=[not e.errored for e in episodes])
    # 5. PPO-clip updates, unless every group had equal rewards (all advantages 0: no policy gradient)
    if ranks.any((advs != 0).any()):  # every rank takes the same branch
        agent.gen.sleep()  # vLLM hands its GPU memory to the update (the transformers sampler: its buffers)
        stats = {**ppo(policy, ref, opt, episodes, advs, ranks=ranks, **update_kw), "update_skipped": 0}
        agent.gen.load_weights(unwrap(policy))  # vLLM gets the new weights (transformers reads the live ones)
    else:
        stats = {"update_skipped": 1}
    metrics = step_metrics(step, episodes, zero_spread, groups, stats, t1 - t0, time.time() - t1, ranks, dropped)
    return {**metrics, "tally": tally_rewards(episodes, tasks, keys or sorted({task_key(t) for t in tasks}),
                                               ranks).tolist()}

def collect(agent, world, tasks, *, step, seed, batch_tasks, group, reward_basis, drop_zero_spread, ranks,
            weights=None):
    """Play G episodes of this rank's share of B tasks (drawn uniformly, or by `weights`), each scored by the world.
    With drop_zero_spread (DAPO's dynamic sampling), groups whose rewards are all equal are replaced by fresh tasks
    (up to 3 extra rounds). -> (kept episodes in group order, zero-spread groups, groups played, episodes of the
    groups dropped: counted in the step's metrics, so that a step whose every episode errored says so)."""
    rng = random.Random(seed * 1000003 + step * ranks.n_ranks + ranks.rank)
    want = max(1, batch_tasks // ranks.n_ranks)
    kept, dropped, zero_spread, groups, rounds = [], [], 0, 0, 0
    while len(kept) < want * group and rounds < (4 if drop_zero_spread else 1):
        n = want - len(kept) // group
        batch = [rng.choice(tasks) for _ in range(n)] if weights is None else rng.choices(tasks, weights, k=n)
        batch = [t for t in batch for _ in range(group)]  # G copies of each task in a row: a group
        episodes = run_episodes(agent, world, batch, seed=rng.randrange(2**31))
        for ep, task in zip(episodes, batch):
            if not ep.errored:  # a failed user simulator says nothing about the policy: not scored
                world.score(ep, task, reward_basis)  # the 0/1 task reward
        groups += n
        for g in range(n):
            grp = episodes[g * group:(g + 1) * group]
            if not has_spread(grp):
                zero_spread += 1
                if drop_zero_spread:
                    dropped += grp
                    continue
            kept += grp
        rounds += 1
    return kept, zero_spread, groups, dropped

def has_spread(grp):
    """Whether a group's scored (not errored) rewards differ: only then does it carry a gradient."""
    return len({e.reward for e in grp if not e.errored}) > 1


# ----------------------------------------------------------------------------------------------------
# the objective

def group_advantages(rewards, group, mean_only=False, std_floor=1e-4, valid=None):
    """rewards (N*G,) in group order -> advantages (N*G,): (r - mean_g) / (std_g + std_floor), or r - mean_g.
    valid (N*G,) bools: only valid episodes (not errored) enter their group's mean and std; the others get 0,
    and so does every episode of a group whose valid rewards are all equal (no spread, no signal)."""
    r = torch.as_tensor(rewards, dtype=torch.float).view(-1, group)
    v = torch.ones_like(r, dtype=torch.bool) if valid is None else torch.as_tensor(valid, dtype=torch.bool)
    v = v.view(r.shape)
    n = v.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(v, r, 0.0).sum(-1, keepdim=True) / n
    adv = torch.where(v, r - mean, 0.0)
    if not mean_only:
        adv = adv / ((adv ** 2).sum(-1, keepdim=True) / n).sqrt().add(std_floor)
    hi = torch.where(v, r, -torch.inf).amax(-1, keepdim=True)
    lo = torch.where(v, r, torch.inf).amin(-1, keepdim=True)
    return torch.where(hi > lo, adv, 0.0).view(-1)

def ppo(policy, ref, opt, episodes, advs, *, ppo_epochs, mini_batches, micro_batch, clip, beta, grad_clip,
        temperature, seed, ranks):
    """PPO epochs over the step's episodes, in mini-batches, one update (optimizer step) each. An episode with
    advantage 0 (every one of a zero-spread group) adds exactly zero gradient at beta 0, so it is not run; its
    tokens still count in the mini-batch's token mean, as if it had run. Errored episodes are left out entirely.
    -> the updates' mean stats."""
    stats, order = collections.Counter(), list(range(len(episodes)))
    for epoch in range(ppo_epochs):
        random.Random(seed + epoch).shuffle(order)
        for mb in range(mini_batches):
            idx = [i for i in order[mb::mini_batches] if not episodes[i].errored]
            # the loss is a mean over every policy token of the mini-batch, on every rank (token-level)
            n_tokens = ranks.tokens(sum(sum(episodes[i].loss_mask) for i in idx))
            work = sorted([i for i in idx if beta > 0 or advs[i] != 0], key=lambda i: len(episodes[i].ids))
            chunks = [work[k:k + micro_batch] for k in range(0, len(work), micro_batch)]  # similar lengths: less pad
            batches = [episode_batch([episodes[i] for i in c], advs[c], ranks.device) for c in chunks]
            stats.update(update(policy, ref, opt, ranks.even(batches, lambda: dummy_batch(ranks.device)),
                                n_tokens=n_tokens, clip=clip, beta=beta, grad_clip=grad_clip, temperature=temperature))
    n = ppo_epochs * mini_batches
    return {"loss": stats["loss"] / n, "clip_frac": stats["clip_frac"] / n, "kl": stats["kl"] / n,
            "grad_norm": stats["grad_norm"] / n, "entropy": stats["entropy_sum"] / max(1.0, stats["entropy_n"])}

def update(policy, ref, opt, batches, *, n_tokens, clip, beta, grad_clip, temperature):
    """One optimizer step over a mini-batch: for each micro-batch of padded episodes, forward (the new log-probs,
    and the reference's with beta > 0), the PPO-clip loss summed over its policy tokens and divided by n_tokens,
    backward; then the gradient clipped and the step taken. -> sums for ppo's stats."""
    stats = collections.Counter()
    for ids, mask, attn, old, adv in batches:  # (B, T), (B, T-1), (B, T), (B, T-1), (B,)
        with autocast(ids.device):
            new, ent = forward_logprobs(policy, ids, attn, temperature)  # (B, T-1) each
            ref_lp = None
            if ref is not None:
                with torch.no_grad():
                    ref_lp, _ = forward_logprobs(ref, ids, attn, temperature)
        loss_sum, st = policy_loss(new, old, adv, mask, clip, beta, ref_lp)
        (loss_sum / n_tokens).backward()  # a token-level mean over the mini-batch, however it is split
        stats.update(loss=float(loss_sum.detach()) / n_tokens, clip_frac=float(st["clipped"]) / n_tokens,
                     kl=float(st.get("kl", 0.0)) / n_tokens, entropy_sum=float((ent.detach() * mask).sum()),
                     entropy_n=float(mask.sum()))
    stats["grad_norm"] = clip_grad(policy, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return stats

def policy_loss(new_lp, old_lp, adv, mask, clip=0.2, beta=0.0, ref_lp=None):
    """Per-token PPO-clip loss (+ beta * k3 KL), SUMMED over masked tokens; the caller divides by the number of
    policy tokens of the mini-batch. new_lp, old_lp, ref_lp, mask: (B, T); adv: (B,).
    Returns (loss_sum, stats) with stats summed over masked tokens too."""
    ratio = torch.exp(new_lp - old_lp)
    a = adv[:, None]
    unclipped, clipped = ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a
    per_tok = -torch.minimum(unclipped, clipped)
    stats = {"clipped": ((clipped < unclipped).float() * mask).sum().detach()}
    if beta > 0:
        d = ref_lp - new_lp
        k3 = torch.exp(d) - d - 1  # unbiased, always >= 0 estimator of KL(pi || ref)
        per_tok = per_tok + beta * k3
        stats["kl"] = (k3 * mask).sum().detach()
    return (per_tok * mask).sum(), stats

def forward_logprobs(model, ids, attn, temperature):
    """log-probs of ids[:, 1:] and the entropy of each predictive distribution, (B, T-1) each, computed a chunk of
    rows at a time (rollout.logprobs_chunked: the (B, T, vocab) logits never exist at once)."""
    return logprobs_chunked(model, ids, attn, temperature, with_entropy=True)[:2]

def episode_batch(episodes, advs, device):
    """Episodes -> right-padded tensors aligned with next-token prediction (position t predicts ids[t+1]):
    ids, attn (B, T); mask, old log-probs (B, T-1); advantages (B,)."""
    ids, mask, attn = pad_batch([(e.ids, e.loss_mask) for e in episodes], 0, device)
    old = torch.zeros_like(mask)
    for b, e in enumerate(episodes):
        old[b, :len(e.logprobs)] = torch.tensor(e.logprobs)
    return ids, mask[:, 1:], attn, old[:, 1:], advs.to(device)


# ----------------------------------------------------------------------------------------------------
# the loop around the step: flags, setup (the GPU machinery sits in rollout.ModelSetup and VLLMGenerator), the steps,
# logging and checkpoints

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default="data", help="synth.py's folder: shop.json and train_tasks.jsonl")
    g.add_argument("--tasks", dest="tasks_file", default=None, help="or any tau2 tasks.json / our JSONL (with --db); "
                   "with --domain: its tasks on tau2's code (a split_tasks.json beside picks --split)")
    g.add_argument("--db", dest="db_file", default=None, help="the db.json the --tasks run on")
    g.add_argument("--domain", default=None, choices=env.TAU2_DOMAINS,
                   help="a tau2-bench domain, run and scored by tau2's own code (needs requirements-tau2.txt)")
    g.add_argument("--tau1", default=None, choices=["retail", "airline"],
                   help="a tau-bench v1 domain (../shared/tau1, or MUA_TAU1_DIR) on v1's semantics; retail's train "
                        "split: the paper's 500 training tasks")
    g.add_argument("--split", default="train",
                   help="with --domain or --tau1: the task split to train on (with --domain, --tasks replaces it)")
    g.add_argument("--policy-file", default=None,
                   help="domain policy for the agent's system prompt (default: policy.md beside --tasks, if there; "
                        "'none': the generated shop's short prompt)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="out/sft", help="an sft.py run folder, a checkpoint folder or a hub id")
    g.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="the rollout sampler")
    g.add_argument("--vllm-gpu-memory", type=float, default=0.5,
                   help="vLLM's share of each GPU while it samples (it sleeps during updates)")
    g.add_argument("--thinking", default=None, choices=["on", "off"],
                   help="Qwen3-style templates: enable_thinking on or off (default: the template's)")
    g = p.add_argument_group("rollout")
    g.add_argument("--batch-tasks", type=int, default=16, help="B: tasks per step (global; demo: 16 scored on the "
                   "training tasks like 60 steps of 8, in 3/4 of the time)")
    g.add_argument("--group", type=int, default=8, help="G: rollouts per task")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (also in the ratio)")
    g.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (default 16, paper: 30; with "
                   "--domain: none, tau2's own 200 steps and 10 errors end it, and a value here can only lower that)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="per agent turn (the tiny model's longest ~40)")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per episode (tiny: an oracle one is <600)")
    g.add_argument("--reward-basis", default="task", choices=["db", "task"],
                   help="db: the database check alone (the paper's training reward); task: what evaluate.py scores "
                        "(the database and the information the agent had to communicate; with --domain: the task's "
                        "own reward basis through tau2's evaluator)")
    g.add_argument("--drop-zero-spread", action="store_true", help="replace groups whose rewards are all equal")
    g.add_argument("--task-sampling", default="uniform", choices=["uniform", "spread"],
                   help="draw tasks uniformly, or by the reward variance p(1-p) of their kind's running success rate "
                        "(tasks every rollout solves, or none does, carry no gradient)")
    add_user_args(p)
    g.add_argument("--max-errored-steps", type=int, default=3, help="stop (non-zero exit) after this many "
                   "consecutive steps in which every episode errored, e.g. a dead user endpoint (0: never stop)")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=60, help="GRPO steps (demo: from seed 0's SFT, pass^1 on 200 training "
                   "tasks x 2 went 51.0 -> 53.5 at 30 steps -> 54.5 at 60; the training reward still rose)")
    g.add_argument("--lr", type=float, default=1e-4, help="tiny model (5e-5 learned a third as fast on "
                   "training tasks, 2e-4 no faster); the paper: 1e-6 on 8B")
    g.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    g.add_argument("--beta", type=float, default=0.0, help="k3 KL weight; 0 loads no reference model")
    g.add_argument("--mean-only", action="store_true", help="advantage r - mean (no division by the std)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each step's episodes")
    g.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per PPO epoch")
    g.add_argument("--micro-batch", type=int, default=16, help="episodes per forward/backward")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    g.add_argument("--seed", type=int, default=0, help="seeds task sampling, rollouts and the users")
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--out", default="out/grpo", help="run folder: metrics.jsonl, reward.png, step_N/, latest")
    g.add_argument("--save-every", type=int, default=10, help="checkpoint every n steps (and at the end)")
    g.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    g.add_argument("--wandb", default=None, help="a wandb project name, if wandb is installed")
    g.add_argument("--overwrite", action="store_true", help="delete an earlier run in --out first (else refused)")
    add_scale_args(p)
    a = p.parse_args(argv)
    cpu_threads()  # the same numbers on any CPU (rollout.cpu_threads)
    n_ranks = int(os.environ.get("WORLD_SIZE", "1"))
    check_flags(p, a, [  # checked up front: a bad value used to give NaN, no update or no checkpoint
            ("--temperature", a.temperature > 0, "> 0 (GRPO's ratio divides the logits by it)"),
            ("--group", a.group >= 2, ">= 2 (a group of one has no spread, so never an update)"),
            ("--batch-tasks", a.batch_tasks >= n_ranks, f">= the number of ranks ({n_ranks})"),
            ("--steps", a.steps >= 1, ">= 1"), ("--max-turns", a.max_turns is None or a.max_turns >= 1, ">= 1"),
            ("--max-new-tokens", a.max_new_tokens >= 1, ">= 1"), ("--max-len", a.max_len >= 2, ">= 2"),
            ("--lr", a.lr > 0, "> 0"), ("--clip", a.clip > 0, "> 0"), ("--beta", a.beta >= 0, ">= 0"),
            ("--ppo-epochs", a.ppo_epochs >= 1, ">= 1"), ("--mini-batches", a.mini_batches >= 1, ">= 1"),
            ("--micro-batch", a.micro_batch >= 1, ">= 1"), ("--grad-clip", a.grad_clip > 0, "> 0"),
            ("--save-every", a.save_every >= 1, ">= 1"), ("--max-errored-steps", a.max_errored_steps >= 0, ">= 0")])
    if a.tau1 and (a.domain or a.tasks_file):
        p.error("--tau1 trains on v1's own tasks: not with --domain or --tasks")
    claim_or_stop(p, a.out, a.resume, a.overwrite)
    del a.overwrite
    return train(**vars(a))

def train(*, model, out, data_dir, tasks_file, db_file, policy_file, backend, vllm_gpu_memory, thinking, steps,
          batch_tasks, group, temperature, max_turns, max_new_tokens, max_len, reward_basis, drop_zero_spread,
          task_sampling, user, user_model, user_guidelines, max_errored_steps, llm_concurrency, llm_deadline, lr, clip,
          beta, mean_only, ppo_epochs, mini_batches, micro_batch, grad_clip, seed, save_every, resume, wandb, fsdp,
          cpu_offload, activation_checkpointing, lora_rank, lora_alpha, domain=None, tau1=None, split="train"):
    """The GRPO loop. -> (policy, tokenizer); under torchrun the process ends instead (rollout.leave_ranks)."""
    # --- setup: the world and its tasks, the policy (rollout.ModelSetup: FSDP2, LoRA, the memory plan), the sampler
    config = dict(locals())
    if temperature <= 0:
        raise ValueError(f"GRPO needs temperature > 0 (got {temperature}): log-probs divide the logits by it")
    # the world first: a run with no tasks must stop before it touches the run folder
    users = user_backend(user, user_model, concurrency=llm_concurrency, deadline=llm_deadline)
    guidelines = env.load_guidelines(user_guidelines) if user_guidelines else None
    if tau1:  # a tau-bench v1 domain: its split, tools, wiki, users and reward
        world = env.Tau1(tau1, user=users, guidelines=guidelines, max_turns=max_turns)
        train_tasks, tasks_path = world.tasks(split), f"{world.name} split {split}"
    elif domain:  # a tau2 domain on tau2's code: its split, tools, policy, users and evaluator
        world = env.Tau2(domain, db=db_file, user=users, guidelines=guidelines, max_turns=max_turns)
        train_tasks = world.tasks(split, path=tasks_file)
        tasks_path = f"tau2 {domain} split {split} of {tasks_file or 'its tasks'}"
    else:
        tasks_path = tasks_file or os.path.join(data_dir, "train_tasks.jsonl")
        beside = env.guidelines_beside(tasks_file)  # tau2's, where its tasks file sits in tau2's data layout
        world = env.Shop(env.load_db(db_file or os.path.join(data_dir, "shop.json")), user=users,
                         max_turns=max_turns or 16, policy=env.policy_text(policy_file, tasks_file),
                         guidelines=guidelines or (env.load_guidelines(beside) if beside else None))
        train_tasks = env.load_tasks(tasks_path)
    if not train_tasks:
        raise SystemExit(f"grpo.py: no tasks in {tasks_path}")
    rank, n_ranks, device = setup_distributed()
    ranks = Ranks(rank, n_ranks, device)
    if backend == "vllm":
        require_vllm()
    setup = ModelSetup.resolve(fsdp=fsdp, cpu_offload=cpu_offload, activation_checkpointing=activation_checkpointing,
                               lora_rank=lora_rank, lora_alpha=lora_alpha, n_ranks=n_ranks, device=device)
    if backend == "hf" and setup.fsdp and n_ranks > 1:  # each rank's sampling runs its own number of forwards
        raise SystemExit("the transformers sampler cannot sample from a policy sharded over ranks (every FSDP "
                         "forward is a collective): use --backend vllm, or --fsdp off")
    setup.check_memory(model, beta=beta, vllm_fraction=vllm_gpu_memory if backend == "vllm" else 0.0,
                       seq_len=max_len, micro_batch=micro_batch, max_new_tokens=max_new_tokens)
    torch.manual_seed(seed)
    os.makedirs(out, exist_ok=True)
    resuming = resume and os.path.isfile(os.path.join(out, "latest"))
    state = load_train_state(out) if resuming else {}  # memory-mapped: AdamW's state is read shard by shard
    # checkpoints hold merged weights: a LoRA run resumes from its base model and the saved adapter
    policy, tok = load_model(out if resuming and not lora_rank else model, **setup.load_kw)
    set_thinking(tok, thinking)
    ref = None
    if beta > 0 and not lora_rank:  # the reference is the starting policy (--model), frozen, also when resuming
        ref = setup.prepare_frozen(load_model(model, **setup.load_kw)[0] if resuming else copy.deepcopy(policy))
    policy = setup.prepare(policy, lora_state=state.get("lora"))
    if beta > 0 and lora_rank:  # with LoRA the starting policy is the policy with its adapters off
        ref = AdapterOff(policy)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.99))
    start = 0
    # running [successes, scored rollouts] per task kind (per task where tasks have no kind), for --task-sampling
    keys = sorted({task_key(t) for t in train_tasks})
    tally = state.get("tally", torch.zeros(len(keys), 2, dtype=torch.float64))
    if resuming:
        load_optimizer_state(policy, opt, state["optimizer"])
        start = state["step"]
    if backend == "vllm":
        # the engine holds one episode and one more turn; it sleeps through updates; it re-seeds the process
        gen = VLLMGenerator(resolve_checkpoint(out if resuming else model), tok,
                            max_model_len=max_len + max_new_tokens, seed=seed, sleep=True,
                            gpu_memory_utilization=vllm_gpu_memory)
    else:
        gen = HFGenerator(unwrap(policy), tok)
    agent = TokenAgent(gen, tok, max_new_tokens=max_new_tokens, temperature=temperature, max_len=max_len)
    # --- the steps, each logged; checkpoints every --save-every steps
    log = open_metrics(os.path.join(out, "metrics.jsonl"), start) if rank == 0 else None
    wb = _wandb(wandb, config) if rank == 0 else None
    bar = tqdm(range(start, steps), initial=start, total=steps, disable=rank != 0, desc="grpo")
    errored = collections.Counter()  # why episodes errored over the run (this rank's; counts are global per step)
    dead = 0  # consecutive steps in which every episode errored: nothing to learn from, and likely no end to it
    update_kw = dict(ppo_epochs=ppo_epochs, mini_batches=mini_batches, micro_batch=micro_batch, clip=clip,
                     beta=beta, grad_clip=grad_clip, temperature=temperature, seed=seed)
    for step in bar:
        weights = task_weights(train_tasks, keys, tally) if task_sampling == "spread" else None
        rec = grpo_step(policy, ref, opt, agent, world, train_tasks, step=step, seed=seed, batch_tasks=batch_tasks,
                        group=group, reward_basis=reward_basis, mean_only=mean_only,
                        drop_zero_spread=drop_zero_spread, update_kw=update_kw, ranks=ranks, weights=weights,
                        keys=keys)
        tally += torch.tensor(rec.pop("tally"), dtype=torch.float64).view(-1, 2)
        errored.update(rec.get("errored_reasons", {}))
        if rank == 0:
            bar.set_postfix(reward="-" if rec["reward_mean"] is None else f"{rec['reward_mean']:.2f}",
                            zero=f"{rec['zero_spread_frac']:.2f}")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if wb:
                wb.log(rec)
        dead = dead + 1 if rec["errored"] == rec["episodes"] > 0 else 0  # global counts: every rank agrees
        if max_errored_steps and dead >= max_errored_steps:
            raise SystemExit(f"grpo.py: every episode errored in {dead} consecutive steps ({step + 2 - dead}-{step + 1}"
                             f"; {rec['errored']} of {rec['episodes']} in the last), the first because "
                             f"{next(iter(rec.get('errored_reasons', {})), 'unknown')}; stopped (--max-errored-steps "
                             f"{max_errored_steps}), the weights as at the last checkpoint")
        if (step + 1) % save_every == 0 or step + 1 == steps:  # every rank: FSDP gathers the weights first
            save_checkpoint(out, step + 1, policy, tok, opt, extra={"tally": tally})
    if rank == 0:
        plot_metrics(os.path.join(out, "metrics.jsonl"), os.path.join(out, "reward.png"))
        if errored:  # their rewards were left out of every mean and every advantage; say how many and why
            print(f"grpo.py: {sum(errored.values())} episodes errored (not scored): "
                  + "; ".join(f"{n}x {reason}" for reason, n in errored.most_common()), flush=True)
    if wb:
        wb.finish()
    if n_ranks > 1:
        leave_ranks()  # under torchrun the process ends here (see there why)
    return unwrap(policy), tok


# ====================================================================================================
# Machinery: a first reading stops here. What a rank with no work runs, task sampling by running success
# (--task-sampling spread), the step's metrics, the reward plot.
# ====================================================================================================

def dummy_batch(device):
    """What a rank with less work runs so that its collectives match the others' (Ranks.even): one 2-token
    sequence with no policy token, so its loss is exactly 0."""
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    zeros = torch.zeros((1, 1), device=device)
    return ids, zeros, torch.ones_like(ids), zeros.clone(), torch.zeros(1, device=device)

def tally_rewards(episodes, tasks, keys, ranks):
    """-> (len(keys), 2) float64: the (successes, scored rollouts) of the step's episodes per task key, summed
    over ranks. Errored episodes, and any whose task is not in `tasks`, are left out."""
    tally = torch.zeros(len(keys), 2, dtype=torch.float64)
    key_of = {t["id"]: task_key(t) for t in tasks}
    for e in episodes:
        if not e.errored and e.task_id in key_of:
            tally[keys.index(key_of[e.task_id])] += torch.tensor([e.reward, 1.0], dtype=torch.float64)
    return ranks.sum(tally)

def task_key(task):
    """What --task-sampling keeps a success rate for: the task's kind (generated tasks), else the task itself."""
    return task.get("kind") or task["id"]

def task_weights(tasks, keys, tally, floor=0.02):
    """One weight per task: p (1 - p), the variance of a 0/1 reward, for p the Laplace-smoothed running success
    rate of its key; 0 exactly where a group can carry no gradient (p at 0 or 1), so a floor keeps every key
    drawn now and then (the policy changes). tally: (len(keys), 2) running (successes, rollouts)."""
    p = (tally[:, 0] + 1) / (tally[:, 1] + 2)
    w = (p * (1 - p)).clamp(min=floor).tolist()
    return [w[keys.index(task_key(t))] for t in tasks]

def step_metrics(step, episodes, zero_spread, groups, stats, rollout_s, update_s, ranks, dropped=()):
    """One JSONL line; episode sums are summed over ranks so every rank logs the global numbers. `episodes`: the
    kept episodes; `dropped`: those of groups collect() dropped, counted in "episodes" and "errored" only."""
    ok = [e for e in episodes if not e.errored]
    t = ranks.sum(torch.tensor([sum(e.reward for e in ok), len(ok), len(episodes) - len(ok), zero_spread, groups,
                                sum(e.turns for e in episodes), sum(e.tool_calls for e in episodes),
                                sum(e.tool_errors for e in episodes), sum(sum(e.loss_mask) for e in episodes),
                                len(dropped), sum(e.errored for e in dropped)], dtype=torch.float64)).tolist()
    n = max(1.0, t[1] + t[2])
    why = errored_reasons(list(episodes) + list(dropped))
    # reward_mean is None (null) when every episode errored: 0.0 would read as a policy that solved nothing
    return {"step": step + 1, "reward_mean": t[0] / t[1] if t[1] else None, "errored": int(t[2] + t[10]),
            "episodes": int(t[1] + t[2] + t[9]), **({"errored_reasons": dict(why)} if why else {}),
            "zero_spread_frac": t[3] / max(1.0, t[4]),
            "turns": t[5] / n, "tool_calls": t[6] / n, "tool_errors": t[7] / n, "tokens_generated": int(t[8]),
            **{k: round(v, 6) for k, v in stats.items()}, "rollout_s": round(rollout_s, 2),
            "update_s": round(update_s, 2)}
def plot_metrics(jsonl, png):
    """Reward and zero-spread fraction over steps (needs matplotlib, an optional dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = [json.loads(line) for line in open(jsonl)]
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, [float("nan") if r["reward_mean"] is None else r["reward_mean"] for r in recs],
            label="reward (mean over rollouts)")
    ax.plot(steps, [r["zero_spread_frac"] for r in recs], label="zero-spread groups (fraction)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png

def _wandb(project, config):
    if not project:
        return None
    try:
        import wandb
    except ImportError:
        print("wandb not installed; logging to metrics.jsonl only")
        return None
    return wandb.init(project=project, config=config)


if __name__ == "__main__":
    main()
