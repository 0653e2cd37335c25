"""
grpo.py: MUA-RL's reinforcement learning. The policy plays whole conversations with a simulated user,
calling real tools, and learns from the 0/1 task reward alone with GRPO (no value model).

    python grpo.py --model out/sft                       # CPU demo: SFT model, scripted user (the default)
    python grpo.py --model out/sft/init --out out/grpo_rl_only     # RL from the untrained model
    python grpo.py --model out/sft --user smollm2 --steps 3        # SmolLM2-135M-Instruct plays the user

GPU recipe of the paper (Qwen3-8B after cold-start SFT; 8 ranks; a vLLM server for the user):
    torchrun --nproc_per_node 8 grpo.py --model out/sft_qwen3_8b --backend vllm --group 8 --batch-tasks 32 \
        --lr 1e-6 --clip 0.2 --beta 0.001 --max-turns 30 --max-new-tokens 1024 --max-len 16384 \
        --user http://localhost:8001/v1 --user-model Qwen/Qwen3-8B

One step: sample B train tasks; play G rollouts of each (temperature 1.0) through rollout.run_episodes with
the user in the loop; reward each with env.compute_reward; advantage = (r - group mean) / (group std + eps);
PPO-clipped policy loss against the log-probs frozen at rollout time, summed over the policy's own tokens and
divided by their number in the whole global batch; optional k3 KL to a frozen reference (beta 0: no
reference model is loaded). Groups whose rewards are all equal carry no gradient: they are counted, logged,
and (--drop-zero-spread) replaced by fresh groups; a step in which every group is so skips the update.
"""
import argparse
import copy
import json
import math
import os
import random
import time

import torch
from tqdm import tqdm

import env
from rollout import HFGenerator, VLLMGenerator, run_episodes
from sft import (all_reduce_max, all_reduce_sum, autocast, load_model, logprobs_from_logits, open_metrics,
                 pad_batch, resolve_checkpoint, save_checkpoint, setup_distributed, unwrap)

# ----------------------------------------------------------------------------------------------------
# the objective


def group_advantages(rewards, group, mean_only=False, eps=1e-4):
    """rewards (N*G,) in group order -> advantages (N*G,): (r - mean_g) / (std_g + eps), or r - mean_g."""
    r = torch.as_tensor(rewards, dtype=torch.float).view(-1, group)
    adv = r - r.mean(-1, keepdim=True)
    if not mean_only:
        adv = adv / (r.std(-1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


def policy_loss(new_lp, old_lp, adv, mask, clip=0.2, beta=0.0, ref_lp=None):
    """Per-token PPO-clip loss (+ beta * k3 KL), SUMMED over masked tokens; the caller divides by the number of
    policy tokens in the global batch. new_lp, old_lp, ref_lp, mask: (B, T); adv: (B,).
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
    """log-probs of ids[:, 1:] and the entropy of each predictive distribution, (B, T-1) each."""
    return logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, temperature, True)


def episode_batch(eps, advs, device):
    """Episodes -> right-padded tensors aligned with next-token prediction (position t predicts ids[t+1])."""
    ids, mask, attn = pad_batch([(e.ids, e.loss_mask) for e in eps], 0, device)
    old = torch.zeros_like(mask)
    for b, e in enumerate(eps):
        old[b, :len(e.logprobs)] = torch.tensor(e.logprobs)
    return ids, mask[:, 1:], attn, old[:, 1:], advs.to(device)


def update(model, ref, opt, eps, advs, args, device, world):
    """PPO epochs over the step's episodes, in mini-batches (one optimizer step each) of micro-batches.
    With beta 0 an episode whose advantage is 0 (every episode of a zero-spread group) contributes exactly zero
    gradient, so its forward/backward is skipped; it still counts in the token denominator, so the loss (and
    the gradient) is the same as if it had run. Here that is half the episodes or more."""
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "grad_norm": 0.0}  # means over optimizer steps
    ent_sum, ent_n = 0.0, 0.0  # entropy: a mean over the policy tokens that ran on this rank
    order = list(range(len(eps)))
    n_updates = 0
    for epoch in range(args.ppo_epochs):
        random.Random(args.seed + epoch).shuffle(order)
        for mb in range(args.mini_batches):
            idx = order[mb::args.mini_batches]
            # token-level normalisation over the global mini-batch: count policy tokens on every rank
            total = all_reduce_sum(torch.tensor(float(sum(sum(eps[i].loss_mask) for i in idx))))
            total = max(1.0, float(total))
            # micro-batches of similar lengths pad less; the summed loss, hence the gradient, is the same
            work = sorted((i for i in idx if args.beta > 0 or advs[i] != 0), key=lambda i: len(eps[i].ids))
            chunks = [work[k:k + args.micro_batch] for k in range(0, len(work), args.micro_batch)]
            # DDP all-reduces gradients inside every backward: each rank must run as many, so a rank with fewer
            # chunks runs dummy ones (an episode with its loss times 0)
            n_chunks = int(all_reduce_max(torch.tensor(len(chunks))))
            for k in range(n_chunks):
                sub, scale = (chunks[k], 1.0) if k < len(chunks) else (idx[:1], 0.0)
                ids, mask, attn, old, adv = episode_batch([eps[i] for i in sub], advs[sub], device)
                with autocast(device):
                    new, ent = forward_logprobs(model, ids, attn, args.temperature)
                    ref_lp = None
                    if ref is not None:
                        with torch.no_grad():
                            ref_lp, _ = forward_logprobs(ref, ids, attn, args.temperature)
                loss, st = policy_loss(new, old, adv, mask, args.clip, args.beta, ref_lp)
                # DDP averages over ranks; * world keeps the global token mean
                (loss * (scale / total * world)).backward()
                stats["loss"] += scale * float(loss.detach()) / total
                stats["clip_frac"] += scale * float(st["clipped"]) / total
                stats["kl"] += scale * float(st.get("kl", 0.0)) / total
                ent_sum += scale * float((ent.detach() * mask).sum())
                ent_n += scale * float(mask.sum())
            stats["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            n_updates += 1
    return {**{k: v / n_updates for k, v in stats.items()}, "entropy": ent_sum / max(1.0, ent_n)}


# ----------------------------------------------------------------------------------------------------
# one step: rollouts, rewards, advantages


def collect(gen, tok, tasks, db, make_user, args, step, rank, world):
    """Play G rollouts of this rank's share of B tasks; with --drop-zero-spread, groups whose rewards are all
    equal are replaced by fresh tasks (up to 3 extra rounds).
    -> (kept episodes in group order, zero-spread groups, groups played)."""
    rng = random.Random(args.seed * 1000003 + step * world + rank)
    want = max(1, args.batch_tasks // world)
    kept, zero, played, rounds = [], 0, 0, 0
    while len(kept) < want * args.group and rounds < (4 if args.drop_zero_spread else 1):
        batch = [rng.choice(tasks) for _ in range(want - len(kept) // args.group)]
        eps = run_episodes(gen, tok, [t for t in batch for _ in range(args.group)], db, make_user,
                           max_turns=args.max_turns, max_tokens=args.max_len, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=rng.randrange(2**31))
        played += len(batch)
        for g in range(len(batch)):
            grp = eps[g * args.group:(g + 1) * args.group]
            rs = [e.reward for e in grp if not e.errored]
            if len(set(rs)) <= 1:
                zero += 1
                if args.drop_zero_spread:
                    continue
            kept += grp
        rounds += 1
    return kept, zero, played


def grpo_step(policy, ref, opt, gen, tok, tasks, db, make_user, args, step, rank=0, world=1, device="cpu"):
    """Rollouts with the user in the loop, group-normalised advantages, one policy update. -> metrics dict."""
    t0 = time.time()
    eps, zero, played = collect(gen, tok, tasks, db, make_user, args, step, rank, world)
    t1 = time.time()
    advs = group_advantages([e.reward for e in eps], args.group, args.mean_only)
    for i, e in enumerate(eps):
        if e.errored:  # a failed user simulator says nothing about the policy: no gradient from it
            advs[i] = 0.0
    # a batch in which every group has equal rewards carries no policy gradient (all advantages are 0): skip
    # its forward/backward and optimizer step. The count is global, so every rank takes the same branch.
    if float(all_reduce_sum(torch.tensor(float((advs != 0).sum())))) > 0:
        stats = {**update(policy, ref, opt, eps, advs, args, device, world), "update_skipped": 0}
        if isinstance(gen, VLLMGenerator):
            gen.load_weights(unwrap(policy))
    else:
        stats = {"update_skipped": 1}
    return step_metrics(step, eps, zero, played, stats, t1 - t0, time.time() - t1, world)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="out/sft")              # an sft.py run folder, a checkpoint or a hub id
    p.add_argument("--out", default="out/grpo")
    p.add_argument("--data-dir", default="data")              # shop.json and train_tasks.jsonl from synth.py
    p.add_argument("--tasks", default=None)                   # or any tau2 tasks.json / our JSONL ...
    p.add_argument("--db", default=None)                      # ... with its db.json
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-tasks", type=int, default=8)      # B: tasks per step (global)
    p.add_argument("--group", type=int, default=8)            # G: rollouts per task
    p.add_argument("--lr", type=float, default=5e-5)          # tiny model (2e-4 broke it); the paper: 1e-6 on 8B
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--beta", type=float, default=0.0)         # k3 KL weight; 0 loads no reference model
    p.add_argument("--mean-only", action="store_true")        # advantage r - mean (no std division)
    p.add_argument("--drop-zero-spread", action="store_true") # replace groups whose rewards are all equal
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--mini-batches", type=int, default=1)     # optimizer steps per PPO epoch
    p.add_argument("--micro-batch", type=int, default=16)     # episodes per forward/backward
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-turns", type=int, default=16)       # agent turns per episode (paper: 30)
    p.add_argument("--max-new-tokens", type=int, default=64)  # per agent turn; the tiny model's longest is ~40
    p.add_argument("--max-len", type=int, default=1024)      # tokens per episode (tiny: an oracle one is <600)
    p.add_argument("--user", default=None)                    # None: scripted; a model path, "smollm2", or a URL
    p.add_argument("--user-model", default=None)              # model name at that URL
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb", default=None)                   # a project name, if wandb is installed
    args = p.parse_args()
    train(args)


def load_tasks_and_db(args):
    db = env.load_db(args.db or os.path.join(args.data_dir, "shop.json"))
    tasks = env.load_tasks(args.tasks or os.path.join(args.data_dir, "train_tasks.jsonl"))
    return db, tasks


def train(args):
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    resuming = args.resume and os.path.isfile(os.path.join(args.out, "latest"))
    model, tok = load_model(args.out if resuming else args.model, device=device)
    ref = None
    if args.beta > 0:  # the reference is the starting policy (--model), frozen, also when resuming
        ref = (load_model(args.model, device=device)[0] if resuming else copy.deepcopy(model))
        ref = ref.eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    start = 0
    if resuming:
        state = torch.load(os.path.join(resolve_checkpoint(args.out), "train_state.pt"), weights_only=False)
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    policy = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if args.backend == "vllm":
        gen = VLLMGenerator(resolve_checkpoint(args.out if resuming else args.model), tok)
    else:
        gen = HFGenerator(model, tok)
    db, tasks = load_tasks_and_db(args)
    make_user = env.user_factory(args.user, args.user_model)
    log = open_metrics(os.path.join(args.out, "metrics.jsonl"), start) if rank == 0 else None
    wb = _wandb(args) if rank == 0 else None
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=rank != 0, desc="grpo")
    for step in bar:
        rec = grpo_step(policy, ref, opt, gen, tok, tasks, db, make_user, args, step, rank, world, device)
        if rank == 0:
            bar.set_postfix(reward=f"{rec['reward_mean']:.2f}", zero=f"{rec['zero_spread_frac']:.2f}")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if wb:
                wb.log(rec)
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                save_checkpoint(args.out, step + 1, policy, tok, opt)
    if rank == 0:
        plot_metrics(os.path.join(args.out, "metrics.jsonl"), os.path.join(args.out, "reward.png"))
    if world > 1:  # a barrier first: a rank tearing down while another still saves can deadlock in gloo
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return unwrap(policy), tok


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
    ax.plot(steps, [r["reward_mean"] for r in recs], label="reward (mean over rollouts)")
    ax.plot(steps, [r["zero_spread_frac"] for r in recs], label="zero-spread groups (fraction)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def step_metrics(step, eps, zero, played, stats, rollout_s, update_s, world):
    """One JSONL line; episode sums are all-reduced so every rank logs the global numbers."""
    ok = [e for e in eps if not e.errored]
    t = all_reduce_sum(torch.tensor([sum(e.reward for e in ok), len(ok), len(eps) - len(ok), zero, played,
                                     sum(e.turns for e in eps), sum(e.tool_calls for e in eps),
                                     sum(e.tool_errors for e in eps), sum(sum(e.loss_mask) for e in eps)],
                                    dtype=torch.float64)).tolist()
    n = max(1.0, t[1] + t[2])
    return {"step": step + 1, "reward_mean": t[0] / max(1.0, t[1]), "errored": int(t[2]),
            "zero_spread_frac": t[3] / max(1.0, t[4]),
            "turns": t[5] / n, "tool_calls": t[6] / n, "tool_errors": t[7] / n, "tokens_generated": int(t[8]),
            **{k: round(v, 6) for k, v in stats.items()}, "rollout_s": round(rollout_s, 2),
            "update_s": round(update_s, 2)}


def _wandb(args):
    if not args.wandb:
        return None
    try:
        import wandb
    except ImportError:
        print("wandb not installed; logging to metrics.jsonl only")
        return None
    return wandb.init(project=args.wandb, config=vars(args))


if __name__ == "__main__":
    main()
