"""The trainer's CUDA-graphed decoder layers (jetrl/rl/train_graphs.py).

On the GPU: a replayed micro-batch gives hidden states and gradients bit-identical to the eager model at the same
(padded) shape -- across micro-batches of two shapes, gradient accumulation, optimizer steps with the FP8 weight
caches re-quantized in between, and ``zero_grad(set_to_none=True)`` -- under ``bf16``, ``jet`` and ``jet_kv``;
a backward whose activations a later forward overwrote raises; the forward-only graph of a no-grad pass; in exact
mode the rollout's logprobs equal the graphed trainer's. On the CPU: the configuration's checks, that ``auto``
stays eager where graphs cannot run, and the eager first use of a shape (capture on second use). The weight buffers
the graphs read and their refresh: tests/test_refresh_graph.py.
"""

import copy

import pytest
import torch

from jetrl.fp8 import convert_to_float8, get_recipe, refresh_weight_caches, track_optimizer
from jetrl.fp8.refresh_graph import WeightRefresh
from jetrl.models import CausalLM, ModelConfig
from jetrl.rl import GRPOConfig
from jetrl.rl.train_graphs import AUTO_MAX_LENGTHS, TrainingGraphs, auto_length_multiple, unsupported_reason

from .conftest import requires_sm90

CFG = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, qk_norm=True, architecture="Qwen3ForCausalLM")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_config_checks():
    with pytest.raises(ValueError, match="train_cuda_graphs"):
        GRPOConfig(train_cuda_graphs="yes")
    for bad in (0, "x", True):
        with pytest.raises(ValueError, match="train_graph_length_multiple.*'auto' or an int"):
            GRPOConfig(train_graph_length_multiple=bad)
        with pytest.raises(ValueError, match="train_graph_row_multiple.*an int >= 1"):
            GRPOConfig(train_graph_row_multiple=bad)
        with pytest.raises(ValueError, match="train_graph_capture_on_use.*an int >= 1"):
            GRPOConfig(train_graph_capture_on_use=bad)
    assert GRPOConfig().train_graph_length_multiple == "auto" and GRPOConfig().train_graph_row_multiple == 1
    assert GRPOConfig().train_graph_capture_on_use == 2
    with pytest.raises(ValueError, match="train_graph_row_multiple=12 must divide grpo.per_device_train_batch_size=16"):
        GRPOConfig(per_device_train_batch_size=16, train_graph_row_multiple=12)
    assert GRPOConfig(per_device_train_batch_size=16, train_graph_row_multiple=16).train_graph_row_multiple == 16
    assert GRPOConfig(train_cuda_graphs=True).train_cuda_graphs == "on"  # YAML's reading of an override's "on"
    assert GRPOConfig(train_cuda_graphs=False).train_cuda_graphs == "off"


def test_auto_length_multiple_bounds_the_shapes():
    """'auto' keeps 128 up to 768 tokens, then grows in steps of 128 so that every length up to the longest
    sequence pads to one of at most 6 lengths (grouped micro-batches span them all)."""
    assert [auto_length_multiple(n) for n in (1, 512, 768, 769, 1152, 4224)] == [128, 128, 128, 256, 256, 768]
    for n in range(1, 20000, 37):
        multiple = auto_length_multiple(n)
        assert multiple % 128 == 0 and -(-n // multiple) <= AUTO_MAX_LENGTHS


def test_the_command_line_takes_on_and_off():
    from jetrl.run.config import resolve_config
    from jetrl.run.presets import get_preset

    for word in ("on", "off", "auto"):
        assert resolve_config(get_preset("tiny"), None, [f"grpo.train_cuda_graphs={word}"]).grpo.train_cuda_graphs == word


def test_an_eager_use_keeps_its_autograd_graph_private_and_matches_plain_autograd():
    """A shape's eager first use (``_Eager``, capture on second use) runs the layers under an autograd graph of its
    own, released by its backward (the caller's graph holds one node, so no parameter's gradient accumulator lives on
    into a later capture), and gives plain autograd's hidden states and gradients, accumulated into existing .grad
    tensors. On the CPU: the Function, not the graphs."""
    import gc
    import weakref

    from jetrl.rl.train_graphs import _Eager

    class Owner:
        def __init__(self, model):
            self.model = model

        def _eager(self, x):
            rows, length, _ = x.shape
            positions = torch.arange(length).expand(rows, length)
            return self.model.model.run_layers(x, *self.model.model.rotary_emb(positions, x.dtype))

        def bind_grads(self):
            pass

    torch.manual_seed(0)
    plain = CausalLM(CFG)
    wrapped = copy.deepcopy(plain)
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    weights = torch.randn(2, 9, CFG.hidden_size)
    for _ in range(2):  # the second pass accumulates into the first's .grad
        h_plain = plain.hidden_states(ids)
        (h_plain * weights).sum().backward()
        anchor = torch.zeros((), requires_grad=True)
        h = _Eager.apply(wrapped.model.embed_tokens(ids), anchor, Owner(wrapped))
        inner = weakref.ref(h.grad_fn.inner[1])  # the layers' output inside the Function
        loss = (h * weights).sum()
        loss.backward()
        gc.collect()
        assert inner() is None, "the layers' autograd graph outlived the backward"
        assert torch.equal(h, h_plain.detach())
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        if name != "lm_head.weight":
            assert torch.equal(p.grad, q.grad), name
    h = _Eager.apply(wrapped.model.embed_tokens(ids), anchor, Owner(wrapped))
    h.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="eager micro-batch's backward ran twice"):
        h.sum().backward()


def test_cpu_model_is_refused_with_the_reason():
    model = CausalLM(CFG)
    assert "CUDA" in unsupported_reason(model)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        TrainingGraphs(model)
    assert "not a jetrl CausalLM" in unsupported_reason(torch.nn.Linear(2, 2))


def test_trainer_auto_stays_eager_on_cpu_and_on_refuses():
    from jetrl.bench.synthetic import IdTokenizer, parity_reward, random_records
    from jetrl.rl import GRPOTrainer

    def trainer(choice):
        args = GRPOConfig(max_steps=1, num_generations=2, generation_batch_size=2, per_device_train_batch_size=2,
                          gradient_accumulation_steps=1, max_prompt_length=4, max_completion_length=4,
                          train_cuda_graphs=choice)
        return GRPOTrainer(CausalLM(CFG), [parity_reward], args, random_records(2, 4, CFG.vocab_size),
                           tokenizer=IdTokenizer(), recipe="jet", accuracy_func=None)

    assert trainer("auto").train_graphs is None
    with pytest.raises(ValueError, match="train_cuda_graphs='on' cannot apply"):
        trainer("on")


def _models(recipe):
    torch.manual_seed(0)
    eager = CausalLM(CFG).to("cuda", torch.bfloat16)
    graphed = copy.deepcopy(eager)
    if recipe != "bf16":
        eager, graphed = (convert_to_float8(m, get_recipe(recipe)) for m in (eager, graphed))
    return eager, graphed


def _micro_batch(model, ids, hidden_states, weights):
    """A loss over the real (unpadded) positions, as the trainer's: hidden states of the first ``L`` tokens."""
    h = hidden_states(ids)
    loss = (h.float() * weights).sum()
    loss.backward()
    return h.detach().clone()


@cuda
@pytest.mark.parametrize("recipe", ["bf16", "jet", "jet_kv"])
def test_replay_is_bit_identical_to_eager_at_the_padded_shape(recipe):
    eager, graphed = _models(recipe)
    graphs, refresh = TrainingGraphs(graphed, length_multiple=64, capture_on_use=1), WeightRefresh(graphed)
    optimizers = []
    for model in (eager, graphed):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        track_optimizer(opt)
        optimizers.append(opt)
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(3, 50), (3, 100), (3, 64), (2, 120)]  # buckets 64, 128, 64, 128 (two rows: a third shape)
    for step in range(3):
        for rows, length in shapes:
            ids = torch.randint(0, CFG.vocab_size, (rows, length), device="cuda", generator=gen)
            weights = torch.randn(rows, length, CFG.hidden_size, device="cuda", generator=gen)
            padded = torch.nn.functional.pad(ids, (0, graphs.padded_length(length) - length))
            h_eager = _micro_batch(eager, padded, lambda t, n=length: eager.hidden_states(t)[:, :n], weights)
            h_graph = _micro_batch(graphed, ids, graphs.hidden_states, weights)
            assert torch.equal(h_eager, h_graph), (recipe, step, rows, length)
        for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
            if name == "lm_head.weight":  # not in hidden_states
                assert p.grad is None and q.grad is None
                continue
            assert torch.equal(p.grad, q.grad), (recipe, step, name)
        for model, opt in zip((eager, graphed), optimizers):
            opt.step()
            opt.zero_grad(set_to_none=True)
        refresh_weight_caches(eager)
        if refresh.refresh():  # from a captured graph (FP8 recipes), as the trainer does
            graphs.assume_current(refresh.keys)
    assert graphs.num_captures == 3 and graphs.num_replays == 3 * len(shapes)
    assert (refresh.num_captures, refresh.num_replays) == ((0, 0) if recipe == "bf16" else (1, 2)), recipe


@cuda
@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_a_shape_is_captured_on_its_second_use(recipe):
    """The default ``capture_on_use=2``: a shape's first use runs eagerly at the padded shape, its second captures
    (one warm-up), the rest replay; every one equals the eager model at the padded shape, hidden states and the
    gradients accumulated over all of them; a shape used once is never captured; counted shapes are bounded."""
    eager, graphed = _models(recipe)
    graphs = TrainingGraphs(graphed, length_multiple=64)
    assert graphs.capture_on_use == 2
    gen = torch.Generator(device="cuda").manual_seed(4)
    calls = [(2, 40), (2, 50), (2, 64), (3, 100), (2, 30)]  # 64 x4 (eager, capture, replay, replay), 128 once
    for i, (rows, length) in enumerate(calls):
        ids = torch.randint(0, CFG.vocab_size, (rows, length), device="cuda", generator=gen)
        weights = torch.randn(rows, length, CFG.hidden_size, device="cuda", generator=gen)
        padded = torch.nn.functional.pad(ids, (0, graphs.padded_length(length) - length))
        h_eager = _micro_batch(eager, padded, lambda t, n=length: eager.hidden_states(t)[:, :n], weights)
        h_graph = _micro_batch(graphed, ids, graphs.hidden_states, weights)
        assert torch.equal(h_eager, h_graph), (recipe, i)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        if name != "lm_head.weight":
            assert torch.equal(p.grad, q.grad), (recipe, name)
    assert (graphs.num_eager, graphs.num_captures, graphs.num_replays) == (2, 1, 3)
    assert [key[:3] for key in graphs._graphs] == [(2, 64, True)]
    with torch.no_grad():  # a no-grad pass is a shape of its own, captured on its second use too
        ids = torch.randint(0, CFG.vocab_size, (2, 40), device="cuda", generator=gen)
        padded = torch.nn.functional.pad(ids, (0, 24))
        for _ in range(3):
            assert torch.equal(graphs.hidden_states(ids), eager.hidden_states(padded)[:, :40])
    assert (graphs.num_eager, graphs.num_captures, graphs.num_replays) == (3, 2, 5)
    with pytest.raises(ValueError, match="capture_on_use=0 must be an int >= 1"):
        TrainingGraphs(graphed, capture_on_use=0)


@cuda
@pytest.mark.parametrize("recipe", ["bf16", "jet", "jet_kv"])
def test_short_micro_batches_replay_the_full_rows_shape(recipe):
    """With ``row_multiple`` (the trainer's micro-batch size) a micro-batch of fewer rows is padded below with rows of
    token 0 and replays the full micro-batch's graph at its length: no capture of its own. Its hidden states and
    every gradient equal the eager model's on the padded input, whose padding rows the loss never reads."""
    eager, graphed = _models(recipe)
    graphs = TrainingGraphs(graphed, length_multiple=64, row_multiple=4, capture_on_use=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for rows, length in [(4, 50), (3, 60), (1, 33), (2, 64)]:  # one length bucket, one row bucket
        ids = torch.randint(0, CFG.vocab_size, (rows, length), device="cuda", generator=gen)
        weights = torch.randn(rows, length, CFG.hidden_size, device="cuda", generator=gen)
        padded = torch.nn.functional.pad(ids, (0, 64 - length, 0, 4 - rows))
        h_eager = _micro_batch(eager, padded, lambda t, r=rows, n=length: eager.hidden_states(t)[:r, :n], weights)
        h_graph = _micro_batch(graphed, ids, graphs.hidden_states, weights)
        assert h_graph.shape == (rows, length, CFG.hidden_size) and torch.equal(h_eager, h_graph), (recipe, rows)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        if name != "lm_head.weight":
            assert torch.equal(p.grad, q.grad), (recipe, name)
    with torch.no_grad():
        ids = torch.randint(0, CFG.vocab_size, (3, 40), device="cuda", generator=gen)
        padded = torch.nn.functional.pad(ids, (0, 24, 0, 1))
        assert torch.equal(graphs.hidden_states(ids), eager.hidden_states(padded)[:3, :40])
        graphs.hidden_states(ids[:1])
    assert graphs.num_captures == 2 and [key[:3] for key in graphs._graphs] == [(4, 64, True), (4, 64, False)]
    with pytest.raises(ValueError, match="row_multiple=0 must be an int >= 1"):
        TrainingGraphs(graphed, row_multiple=0)


@cuda
def test_a_stale_backward_raises_and_replaced_grads_are_kept():
    _, model = _models("jet")
    graphs = TrainingGraphs(model, length_multiple=64, capture_on_use=1)
    ids = torch.randint(0, CFG.vocab_size, (2, 40), device="cuda")
    first = graphs.hidden_states(ids).float().sum()
    graphs.hidden_states(ids).float().sum().backward()
    with pytest.raises(RuntimeError, match="a later forward has overwritten"):
        first.backward()
    norm = model.model.norm.weight
    before = norm.grad.clone()
    norm.grad = torch.ones_like(norm)  # a replaced gradient is folded into the graph's buffer, not lost
    graphs.hidden_states(ids).float().sum().backward()
    assert torch.equal(norm.grad, before + 1)
    padded = torch.nn.functional.pad(ids, (0, 24))
    attn, captures = model.model.layers[0].self_attn, graphs.num_captures
    with torch.no_grad():  # a write that bypasses the version counter, so its owner says so
        attn.o_proj.weight.data.mul_(0.5)
        attn.o_proj.weight_cache.invalidate()
    got = graphs.hidden_states(ids).clone()  # re-quantized in place before the replay: no recapture
    assert torch.equal(got, model.hidden_states(padded)[:, :40]) and graphs.num_captures == captures
    model.model.norm.weight.data = model.model.norm.weight.data * 2  # a parameter moved: captured again
    got = graphs.hidden_states(ids).clone()
    assert torch.equal(got, model.hidden_states(padded)[:, :40]) and graphs.num_captures == captures + 1
    with torch.no_grad():  # without autograd (an old-logprob pass): a forward graph of its own
        captures, replays = graphs.num_captures, graphs.num_replays
        for _ in range(2):
            assert torch.equal(graphs.hidden_states(ids), model.hidden_states(padded)[:, :40])
        assert (graphs.num_captures, graphs.num_replays) == (captures + 1, replays + 2)


@cuda
def test_gradients_follow_any_zeroing_order_and_shapes_are_evicted():
    _, model = _models("jet")
    graphs = TrainingGraphs(model, length_multiple=64, max_graphs=2, capture_on_use=1)
    params = list(model.model.layers.parameters())
    ids = torch.randint(0, CFG.vocab_size, (2, 40), device="cuda")
    graphs.hidden_states(ids).float().sum().backward()
    expected = [p.grad.clone() for p in params]
    loss = graphs.hidden_states(ids).float().sum()
    model.zero_grad(set_to_none=True)  # between a forward and its backward: the backward still lands in .grad
    loss.backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # a no-grad pass leaves the gradients alone
        graphs.hidden_states(ids)
    assert all(p.grad is None for p in params)
    captures = graphs.num_captures  # two shapes held: training at 64 tokens, then no-grad at 64 (the newer)
    graphs.hidden_states(ids[:, :30].repeat(1, 3)).float().sum().backward()  # 90 -> 128 tokens: evicts training@64
    graphs.hidden_states(ids).float().sum().backward()  # training@64 captured again: evicts no-grad@64
    assert graphs.num_captures == captures + 2 and [key[:3] for key in graphs._graphs] == [(2, 128, True),
                                                                                           (2, 64, True)]


@cuda
@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_trainer_with_graphs_equals_the_eager_trainer(recipe):
    """GRPOTrainer end to end (rollout, old logprobs, update, optimizer, FP8 re-quantization): with a length
    multiple of 1 no input is padded, so after two RL steps the graphed trainer's weights are the eager one's, bit
    for bit. With the default multiple its micro-batches are padded: one step's update then differs from the
    eager one's by rounding (BF16 GEMMs of another shape; FP8 wgrad groups along tokens that take in the
    padding), far less than the update itself."""
    from jetrl.bench.synthetic import IdTokenizer, parity_reward, random_prompts, random_records
    from jetrl.rl import GRPOTrainer
    from jetrl.rl.batch import RolloutBatch

    records = random_records(4, 6, CFG.vocab_size, seed=3)

    def trainer_for(choice, steps, multiple=128, **extra):
        torch.manual_seed(0)
        model = CausalLM(CFG).to("cuda", torch.bfloat16)
        args = GRPOConfig(**{"max_steps": steps, "num_generations": 2, "generation_batch_size": 8,
                             "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                             "max_prompt_length": 6, "max_completion_length": 12, "old_logprobs": "recompute",
                             "train_cuda_graphs": choice, "train_graph_length_multiple": multiple,
                             "learning_rate": 1e-3, **extra})
        return GRPOTrainer(model, [parity_reward], args, records, tokenizer=IdTokenizer(), recipe=recipe,
                           accuracy_func=None)

    def run(choice, steps, multiple=128):
        trainer = trainer_for(choice, steps, multiple)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        history = trainer.train()
        assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in history)
        return trainer, start, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    eager, _, w_eager = run("off", steps=2)
    assert eager.train_graphs is None
    exact, _, w_exact = run("on", steps=2, multiple=1)
    assert exact.train_graphs.num_replays > 0 and exact.train_graphs.row_multiple == 1  # the default: no padding
    assert exact.weight_refresh.num_replays == (3 if recipe == "jet" else 0)  # 4 optimizer steps, 1 capture
    for name, w in w_eager.items():
        assert torch.equal(w, w_exact[name]), name
    _, start, w_one = run("off", steps=1)
    padded, _, w_padded = run("auto", steps=1)
    assert padded.train_graphs is not None and padded.train_graphs.num_replays > 0
    update = sum(float((w_one[n].float() - w.float()).norm()) for n, w in start.items())
    apart = sum(float((w_padded[n].float() - w_one[n].float()).norm()) for n in start)
    assert 0 < update and apart < 0.5 * update, (apart, update)
    # a rollout batch of 6 rows, as dynamic sampling leaves them: micro-batches of 4 and 2 rows; with
    # train_graph_row_multiple=4 the short one is padded and replays the full one's graphs (old logprobs, update)
    gen = torch.Generator().manual_seed(5)
    lengths = [12, 3, 9, 7, 12, 5]
    batch = RolloutBatch.build(random_prompts(6, 6, CFG.vocab_size, seed=5),
                               [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths],
                               [(-3 * torch.rand(n, generator=gen)).tolist() for n in lengths],
                               torch.randn(6, generator=gen), [True] * 6)
    weights = []
    for choice, rows in (("off", 1), ("on", 4)):
        trainer = trainer_for(choice, 1, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                              train_graph_row_multiple=rows)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer._old_logprobs(batch, {})
        trainer._update(batch, {})
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    graphs = trainer.train_graphs
    assert graphs.num_captures == 2 and [key[:3] for key in graphs._graphs] == [(4, 128, False), (4, 128, True)]
    update = sum(float((weights[0][n].float() - w.float()).norm()) for n, w in start.items())
    apart = sum(float((weights[1][n].float() - weights[0][n].float()).norm()) for n in start)
    assert 0 < update and apart < 0.5 * update, (apart, update)


@requires_sm90  # exact mode's kernels
def test_exact_mode_keeps_zero_mismatch_with_graphs():
    """Exact mode (jetrl/exact.py) with the graphs ``auto`` turns on: the trainer's old-logprob pass, replayed from
    a graph at a padded shape, equals the rollout's logprobs at every token of every step, under ``jet_kv``."""
    from jetrl.bench.synthetic import IdTokenizer, parity_reward, random_records
    from jetrl.exact import use_exact
    from jetrl.rl import GRPOTrainer

    torch.manual_seed(0)
    args = GRPOConfig(max_steps=2, num_generations=2, generation_batch_size=8, per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, max_prompt_length=6, max_completion_length=12,
                      old_logprobs="recompute", learning_rate=1e-3)
    with use_exact():
        trainer = GRPOTrainer(CausalLM(CFG).to("cuda", torch.bfloat16), [parity_reward], args,
                              random_records(4, 6, CFG.vocab_size, seed=3), tokenizer=IdTokenizer(), recipe="jet_kv",
                              accuracy_func=None)
        history = trainer.train()
    assert trainer.train_graphs is not None and trainer.train_graphs.num_replays > 0
    for m in history:
        assert m["training/rollout_probs_diff_max"] == 0.0 and m["rollout_corr/kl"] == 0.0, m
