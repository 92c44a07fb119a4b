"""The host-side parts of a point's probes that do not touch the model, old against new, on a
run's own documents: the n-gram index's membership test of non-discoverable extraction (np.isin
against the sorted index, against `NgramIndex.contains`' binary search) and the blind shift check
(every document against at most `shift.MAX_PER_SIDE` a side). Prints JSON lines: seconds
(median of --repeats, variants interleaved), the ratio, and that both variants give the same
answer (the same memorised flags; both verdicts of the shift check).

These parts run on the CPU whatever the accelerator: on the TPU study's tiny points they were
~200 s of ~240 s a point's probes took on the chip.

    python benchmarks/probe_host_side.py RUN_DIR [--samples 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from memaudit.probes.extraction import NgramIndex
from memaudit.probes.shift import blind_check
from memaudit.probes.targets import resolve_target


def _timed(f):
    t = time.perf_counter()
    out = f()
    return time.perf_counter() - t, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--samples", type=int, default=256, help="non-discoverable samples (the probe's nd_samples)")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--ngram", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    t = resolve_target(args.run)
    from memaudit.probes.targets import Codec, load_tokenizer

    codec = Codec(load_tokenizer(t.tokenizer_path))
    train = codec.encode_all([d.text for d in t.members])
    index = NgramIndex(train, args.ngram)
    rng = np.random.default_rng(0)
    # samples as the probe sees them: random tokens, and a quarter holding a training window
    samples = [rng.integers(1, 4000, args.length) for _ in range(args.samples)]
    for s in samples[: args.samples // 4]:
        doc = train[int(rng.integers(len(train)))]
        if len(doc) >= args.ngram:
            j = int(rng.integers(len(doc) - args.ngram + 1))
            s[: args.ngram] = doc[j : j + args.ngram]
    old = lambda: np.array([bool(np.isin(index._hashes(np.asarray(s, np.uint64)), index.hashes).any())
                            for s in samples])
    new = lambda: index.contains(samples)
    members, nonmembers = [d.text for d in t.members], [d.text for d in t.nonmembers]
    full = lambda: blind_check(members, nonmembers, max_per_side=max(len(members), len(nonmembers)))
    capped = lambda: blind_check(members, nonmembers)
    common = {"run": os.path.basename(os.path.normpath(args.run)), "load_avg": os.getloadavg()[0]}
    for item, variants, same in (
        ("ngram_membership", {"isin": old, "searchsorted": new},
         lambda a, b: bool(np.array_equal(a, b))),
        ("shift_check", {"all_documents": full, "at_most_2000_a_side": capped},
         lambda a, b: a["flagged"] == b["flagged"]),
    ):
        times = {k: [] for k in variants}
        outs = {}
        for _ in range(args.repeats):
            for k, f in variants.items():
                dt, outs[k] = _timed(f)
                times[k].append(dt)
        (a, fa), (b, fb) = ((k, statistics.median(v)) for k, v in times.items())
        extra = ({"index_windows": len(index.hashes), "samples": args.samples,
                  "memorised": int(outs[b].sum())} if item == "ngram_membership" else
                 {"members": len(members), "nonmembers": len(nonmembers),
                  "auc_all": round(outs[a]["auc"], 4), "auc_capped": round(outs[b]["auc"], 4)})
        print(json.dumps({**common, "item": item, f"{a}_s": round(fa, 3), f"{b}_s": round(fb, 3),
                          "ratio": round(fa / fb, 1), "same_answer": same(outs[a], outs[b]),
                          "repeats": args.repeats, **extra}), flush=True)


if __name__ == "__main__":
    main()
