"""Decode-step time and KV bytes: OakenCache vs DynamicCache (fp32) vs QuantizedCache (quanto int4).

Same as ``oakenkv bench decode``; kept here so that every benchmark has a script under ``benchmarks/``::

    # --save writes benchmarks/results/decode/<point>.json
    .venv/bin/python benchmarks/bench_decode.py --context 1024,4096,16384 --save
"""

from oakenkv.cli import app

if __name__ == "__main__":
    import sys

    app(["bench", "decode", *sys.argv[1:]])
