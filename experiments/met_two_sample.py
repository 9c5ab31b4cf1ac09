"""Model Equality Testing's two-sample test as its authors run it, on cases read from stdin.

Runs in an environment where the ``model-equality-testing`` package (Gao et al., ICLR 2025) is
installed (``experiments/seedless_power.py --met-python``): for each case, the provider's and the
reference's (prompt index, completion) pairs become ``CompletionSample`` objects (completions
padded with -1 to ``L``) and ``algorithm.run_two_sample_test`` computes ``mmd_hamming`` and its
permutation p-value (``b = 1000``, the package's default). Prints the p-values as a JSON list.
"""

import argparse
import json
import sys

import numpy as np


def padded(rows, length):
    out = np.full((len(rows), length), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        r = list(r)[:length]
        out[i, : len(r)] = r
    return out


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    import torch
    from model_equality_testing.algorithm import run_two_sample_test
    from model_equality_testing.distribution import CompletionSample

    out = []
    for case in json.load(sys.stdin):
        torch.manual_seed(case["seed"])  # the permutations draw from torch's global generator
        prompts = np.asarray(case["prompts"], dtype=np.int64)
        x = CompletionSample(prompts, padded(case["x"], case["L"]), case["m"])
        y = CompletionSample(prompts, padded(case["y"], case["L"]), case["m"])
        p, _ = run_two_sample_test(x, y, pvalue_type="permutation_pvalue", stat_type="mmd_hamming", b=1000)
        out.append(float(p))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
