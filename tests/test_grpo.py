"""GRPO's objective on hand-computed cases, gradient masking, zero-spread groups, pass^k, and a short run
that learns an easy task."""
import copy
import math
import random
from types import SimpleNamespace

import pytest
import torch

import env
import evaluate
import grpo
import rollout
import sft


def test_group_advantages():
    adv = grpo.group_advantages([1, 0, 0, 1, 1, 1], group=2)
    assert adv[0] == pytest.approx(0.5 / (0.5 + 1e-4)) and adv[1] == pytest.approx(-0.5 / (0.5 + 1e-4))
    assert adv[2] == pytest.approx(-adv[0]) and adv[3] == pytest.approx(adv[0])
    assert adv[4] == 0 and adv[5] == 0  # equal rewards: no signal
    adv = grpo.group_advantages([1, 0, 0, 0], group=4, mean_only=True)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_policy_loss_clipping_both_sides_and_mask():
    old = torch.zeros(1, 5)
    new = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5, 3.0]]))  # ratios
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    for adv, expect, n_clipped in [
        (1.0, [-1.2, -1.2, -0.5, -0.5], 2),   # A>0: ratio capped at 1+eps; a small ratio is not raised
        (-1.0, [1.5, 1.5, 0.8, 0.8], 2),      # A<0: ratio floored at 1-eps; a large ratio is kept (pessimistic)
    ]:
        loss, st = grpo.policy_loss(new, old, torch.tensor([adv]), mask, clip=0.2)
        assert float(loss) == pytest.approx(sum(expect))  # the masked token (ratio 3) adds nothing
        assert float(st["clipped"]) == n_clipped
    # the KL term: k3 = e^d - d - 1 with d = ref - new
    ref = new + math.log(2.0)
    loss, st = grpo.policy_loss(new, new.detach(), torch.tensor([0.0]), mask, clip=0.2, beta=0.1, ref_lp=ref)
    k3 = 2 - math.log(2) - 1
    assert float(st["kl"]) == pytest.approx(4 * k3, rel=1e-5)
    assert float(loss) == pytest.approx(0.1 * 4 * k3, rel=1e-5)


def test_pass_hat_k_hand_made():
    table = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    assert evaluate.pass_hat_k(table, 1) == pytest.approx((0.5 + 1 + 0) / 3)
    assert evaluate.pass_hat_k(table, 2) == pytest.approx((1 / 6 + 1 + 0) / 3)
    assert evaluate.pass_hat_k(table, 4) == pytest.approx(1 / 3)
    assert evaluate.pass_hat_k({"a": [1, 0]}, 3) is None  # fewer trials than k
    assert evaluate.pass_hat_k({"a": [1, 1, 1], "b": [0, 1, 1]}, 2) == pytest.approx((1 + 1 / 3) / 2)


def test_pass_at_k_hand_made():
    """At least one success in k trials drawn without replacement: 1 - C(n-c, k) / C(n, k), a mean over tasks."""
    table = {"a": [1, 0, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    assert evaluate.pass_at_k(table, 1) == pytest.approx(evaluate.pass_hat_k(table, 1))  # both are the mean reward
    assert evaluate.pass_at_k(table, 2) == pytest.approx((0.5 + 1 + 0) / 3)  # a: 1 - C(3,2)/C(4,2) = 1/2
    assert evaluate.pass_at_k(table, 4) == pytest.approx(2 / 3)
    assert evaluate.pass_at_k({"a": [1, 0]}, 3) is None
    assert evaluate.pass_at_k(table, 2) >= evaluate.pass_hat_k(table, 2)


# ----------------------------------------------------------------------------------------------------
# a tiny model and hand-made episodes


@pytest.fixture(scope="module")
def tiny():
    convs = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(20)]
    tok, model = sft.make_tiny(convs, 300, 32, 2, 2, seed=0)
    return tok, model


def _episode(tok, mask_pattern, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(tok), (len(mask_pattern),), generator=g).tolist()
    ep = rollout.Episode(task_id="t", messages=[], ids=ids, loss_mask=list(mask_pattern))
    ep.logprobs = [-1.0 * m for m in mask_pattern]
    return ep


class CaptureOpt:
    """Stands in for the optimizer: records the gradient instead of stepping."""

    def __init__(self, model):
        self.params, self.grads = list(model.parameters()), []

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                                     for p in self.params]))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _args(**kw):
    base = dict(ppo_epochs=1, mini_batches=1, micro_batch=8, temperature=1.0, clip=0.2, beta=0.0,
                grad_clip=1e9, seed=0)
    return SimpleNamespace(**{**base, **kw})


def test_token_level_normalisation_across_micro_batches(tiny):
    tok, model = tiny
    eps = [_episode(tok, [0] * 3 + [1] * n + [0] * 2, s) for s, n in enumerate([2, 7, 4, 1])]
    advs = torch.tensor([1.0, -0.5, 0.3, 2.0])
    grads = []
    for mb in (1, 4):
        opt = CaptureOpt(model)
        grpo.update(model, None, opt, eps, advs, _args(micro_batch=mb), "cpu", 1)
        grads.append(opt.grads[0])
    assert torch.allclose(grads[0], grads[1], atol=1e-6)  # the same global token mean however it is split
    # ... and it is the mean over all policy tokens, not a mean of per-episode means
    ids, m, attn, old, adv = grpo.episode_batch(eps, advs, "cpu")
    new, _ = grpo.forward_logprobs(model, ids, attn, 1.0)
    per_tok = grpo.policy_loss(new, old, adv, m)[0]
    (per_tok / m.sum()).backward()
    manual = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    assert torch.allclose(manual, grads[0], atol=1e-6)
    new, _ = grpo.forward_logprobs(model, ids, attn, 1.0)
    ratio, a = torch.exp(new - old), adv[:, None]
    per_seq = (-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * m).sum(-1) / m.sum(-1)
    per_seq.mean().backward()
    seq_mean = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    assert not torch.allclose(seq_mean, grads[0], atol=1e-4)


def test_zero_advantage_episodes_skipped_with_the_same_gradient(tiny, monkeypatch):
    """Episodes of zero-spread groups (advantage 0) are not forwarded when beta is 0, yet their tokens stay in
    the denominator: the gradient equals the full batch's token mean."""
    tok, model = tiny
    eps = [_episode(tok, [0] * 3 + [1] * n + [0] * 2, s) for s, n in enumerate([2, 7, 4, 1, 5, 3])]
    advs = torch.tensor([1.0, 0.0, -0.5, 0.0, 0.0, 2.0])
    ids, m, attn, old, adv = grpo.episode_batch(eps, advs, "cpu")
    new, _ = grpo.forward_logprobs(model, ids, attn, 1.0)
    (grpo.policy_loss(new, old, adv, m)[0] / m.sum()).backward()
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    seen, real = [], grpo.forward_logprobs
    monkeypatch.setattr(grpo, "forward_logprobs", lambda mdl, i, *a: seen.append(i.shape[0]) or real(mdl, i, *a))
    opt = CaptureOpt(model)
    grpo.update(model, None, opt, eps, advs, _args(micro_batch=2), "cpu", 1)
    assert sum(seen) == 3  # only the three episodes with a nonzero advantage ran
    assert torch.allclose(opt.grads[0], full, atol=1e-6) and full.abs().max() > 0
    seen.clear()
    grpo.update(model, copy.deepcopy(model), CaptureOpt(model), eps, advs, _args(beta=0.1), "cpu", 1)
    assert sum(seen) == 2 * 6  # with a KL term every episode has a gradient: all run (policy and reference)


def test_gradient_only_through_policy_tokens(tiny):
    tok, model = tiny
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]  # prompt, agent turn, tool turn, agent turn, user turn
    ep = _episode(tok, mask, 3)
    ids, m, attn, old, adv = grpo.episode_batch([ep], torch.tensor([1.0]), "cpu")
    logits = model(input_ids=ids, attention_mask=attn).logits
    logits.retain_grad()
    new, _ = grpo.logprobs_from_logits(logits, ids, 1.0)
    loss, _ = grpo.policy_loss(new, old, adv, m)
    loss.backward()
    per_pos = logits.grad[0].abs().sum(-1)  # (T,): position t predicts token t+1
    for t in range(len(mask) - 1):
        if mask[t + 1]:
            assert per_pos[t] > 0, t
        else:
            assert per_pos[t] == 0, t  # user / tool / prompt tokens carry no gradient
    model.zero_grad()


def test_equal_rewards_give_no_policy_gradient(tiny):
    tok, model = tiny
    eps = [_episode(tok, [0, 0, 1, 1, 1, 0], s) for s in range(4)]
    advs = grpo.group_advantages([1.0, 1.0, 0.0, 0.0], group=2)
    assert advs.abs().sum() == 0
    opt = CaptureOpt(model)
    grpo.update(model, None, opt, eps, advs, _args(), "cpu", 1)
    assert opt.grads[0].abs().max() == 0


def test_all_equal_rewards_skip_the_update(tiny, monkeypatch):
    """An untrained model never cancels the order: every group is all zeros, so no forward/backward runs."""
    tok, model = tiny
    db, task, oid = _easy_world()
    monkeypatch.setattr(grpo, "update", lambda *a, **k: pytest.fail("update ran on an all-zero-advantage batch"))
    before = [p.detach().clone() for p in model.parameters()]
    args = SimpleNamespace(group=2, batch_tasks=2, drop_zero_spread=False, max_turns=1, max_len=256,
                           max_new_tokens=8, mean_only=False, **vars(_args()))
    rec = grpo.grpo_step(model, None, None, rollout.HFGenerator(model, tok), tok, [task], db,
                         lambda t, s: OneLineUser(oid), args, 0)
    assert rec["update_skipped"] == 1 and rec["zero_spread_frac"] == 1.0 and rec["reward_mean"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ----------------------------------------------------------------------------------------------------
# a short run learns an easy task: the user asks to cancel an order without saying why; the gold reason is
# "ordered by mistake". SFT on both reasons equally makes a model that succeeds about half the time; GRPO
# with the 0/1 database reward should move it clearly above that.


def _easy_world():
    db = env.generate_shop(seed=5, n_users=4)
    order = next(o for o in db["orders"].values() if o["status"] == "pending")
    oid = order["order_id"]
    task = {"id": "easy", "kind": "cancel",
            "user_scenario": {"instructions": {"reason_for_call": f"cancel {oid}"}},
            "evaluation_criteria": {"actions": [{"action_id": "0", "name": "cancel_pending_order", "arguments": {
                "order_id": oid, "reason": "ordered by mistake"}}], "communicate_info": []}}
    return db, task, oid


class OneLineUser:
    def __init__(self, oid):
        self.oid, self.done, self.end_reason, self.error = oid, False, None, None

    def start(self):
        return f"Cancel order {self.oid} please."

    def respond(self, text):
        self.done, self.end_reason = True, "user_stop"
        return "ok ###STOP###"


def _success(gen, tok, db, task, oid, n, seed):
    eps = rollout.run_episodes(gen, tok, [task] * n, db, lambda t, s: OneLineUser(oid), max_turns=2,
                               max_new_tokens=80, temperature=1.0, seed=seed)
    return sum(e.reward for e in eps) / n


def test_short_grpo_run_learns_easy_task():
    torch.manual_seed(0)
    random.seed(0)
    db, task, oid = _easy_world()
    convs = []
    for reason in ["no longer needed", "ordered by mistake"] * 8:
        call = rollout.parse_assistant(f'<tool_call>{{"name": "cancel_pending_order", "arguments": '
                                       f'{{"order_id": "{oid}", "reason": "{reason}"}}}}</tool_call>')
        convs.append({"messages": [{"role": "system", "content": rollout.SYSTEM_PROMPT},
                                   {"role": "user", "content": f"Cancel order {oid} please."}, call,
                                   {"role": "tool", "name": "cancel_pending_order", "content": "done"},
                                   {"role": "assistant", "content": "Cancelled."}]})
    tok, model = sft.make_tiny(convs, 600, 48, 2, 2, seed=0)
    data = [rollout.encode_conversation(tok, c["messages"], env.TOOL_SCHEMAS) for c in convs]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(300):  # SFT until the call is mostly well formed; the reason stays a coin flip
        batch = data[(step * 4) % 16:(step * 4) % 16 + 4]
        total = float(sum(sum(m[1:]) for _, m in batch))
        sft.micro_loss(model, batch, total, "cpu").backward()
        opt.step()
        opt.zero_grad()
    gen = rollout.HFGenerator(model, tok)
    before = _success(gen, tok, db, task, oid, 48, seed=1)
    assert 0.15 < before < 0.85, f"the SFT start should succeed sometimes, got {before}"
    args = SimpleNamespace(group=8, batch_tasks=4, drop_zero_spread=False, max_turns=2, max_len=512,
                           max_new_tokens=80, mean_only=False, **vars(_args()))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)  # ~6x below the SFT rate: RL steps are noisy
    # measured with the compact tiny tokenizer: 0.62 -> 0.73 after 15 steps, 0.88 after 25 (with the older,
    # word-splitting one: 0.48 -> 0.65 after 15). Seeded, one thread: deterministic here. No change would have to
    # beat 1.5 standard errors (~0.1 for a difference of two 48-trial rates) to pass the 0.15 bar
    for step in range(25):
        rec = grpo.grpo_step(model, None, opt, gen, tok, [task], db, lambda t, s: OneLineUser(oid), args, step)
        assert 0.0 <= rec["zero_spread_frac"] <= 1.0 and rec["tokens_generated"] > 0
        assert rec["update_skipped"] == int(rec["zero_spread_frac"] == 1.0)
    after = _success(gen, tok, db, task, oid, 48, seed=2)
    print(f"easy task: success {before:.2f} -> {after:.2f} after 25 GRPO steps")
    assert after >= before + 0.15, (before, after)


# ----------------------------------------------------------------------------------------------------
# DDP: a rank whose episodes all have advantage 0 skips their work but must still join every gradient
# all-reduce, or the other rank hangs in its backward


def _ddp_rank(rank, world, port, model, eps, advs, out):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = CaptureOpt(model)
    mine = slice(rank * 2, rank * 2 + 2)
    grpo.update(ddp, None, opt, eps[mine], advs[mine], _args(micro_batch=1), "cpu", world)
    if rank == 0:
        torch.save(opt.grads[0], out)
    torch.distributed.destroy_process_group()


def test_ddp_rank_with_only_zero_advantages_joins_the_all_reduce(tiny, tmp_path):
    tok, model = tiny
    eps = [_episode(tok, [0] * 3 + [1] * n + [0] * 2, s) for s, n in enumerate([2, 7, 4, 1])]
    advs = torch.tensor([1.0, -0.5, 0.0, 0.0])  # rank 0: two chunks of work, rank 1: none (two dummies)
    opt = CaptureOpt(model)
    grpo.update(model, None, opt, eps, advs, _args(micro_batch=1), "cpu", 1)
    port = 29500 + random.Random().randrange(2000)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, model, eps, advs, tmp_path / "g.pt"),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]  # None: a rank hung
    assert torch.allclose(torch.load(tmp_path / "g.pt"), opt.grads[0], atol=1e-6)
