"""What a step's attention costs when every layer reads its own cache: `npuchat.RopeAttention`
over an f32 cache against `npuchat.RopeAttentionF16` over an f16 one, alternating in each round.

    python benchmarks/kv_read_speed.py [--layers 28] [--heads 12 --kv-heads 2 --dh 128]
                                       [--threads 2] [--rounds 5]

One op per layer, each layer with its own `[1, Hkv, 4096, dh]` K and V bound in place (as the
engine binds them), so a step reads what a model's step reads and, past a few hundred slots,
from DRAM rather than from the caches (one layer's attention timed alone stays in L3 and hides
the difference). Shapes default to Qwen2.5-Coder-1.5B's. Cases: a one-row decode step at 1,024
and 4,000 slots, and a 64-token prefill chunk at 2,000. Prints the median wall and process CPU
ms per step (all layers) and f16 / f32. ONNX Runtime's spinning is off so that the idle
session's threads do not take the other's cores. A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from npuchat.engine.bench_timers import machine_info
from npuchat.engine.custom_ops import DOMAIN, kernel_library, register_kernels
from npuchat.engine.layer_inputs import MASK_NEG

CAPACITY = 4096
CASES = [(1, 1024), (1, 4000), (64, 2000)]  # (new tokens, slots already held)


class Layers:
    """One session of the op and, per layer, its cache and an IO binding over it."""

    def __init__(self, args: argparse.Namespace, half: bool, tokens: int, held: int) -> None:
        f32, kv = TensorProto.FLOAT, TensorProto.FLOAT16 if half else TensorProto.FLOAT
        names = [("qkv", f32), ("cos", f32), ("sin", f32), ("slots", TensorProto.INT64)]
        names += [("past_k", kv), ("past_v", kv), ("mask", f32)]
        inputs = [helper.make_tensor_value_info(n, t, None) for n, t in names]
        outputs = [
            helper.make_tensor_value_info(n, t, None) for n, t in (("y", f32), ("k", kv), ("v", kv))
        ]
        node = helper.make_node(
            "RopeAttentionF16" if half else "RopeAttention",
            [n for n, _ in names],
            ["y", "k", "v"],
            domain=DOMAIN,
            num_heads=args.heads,
            kv_heads=args.kv_heads,
            hidden=MASK_NEG,
        )
        model = helper.make_model(
            helper.make_graph([node], "layer", inputs, outputs),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
        )
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        register_kernels(so, kernel_library())
        self.session = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        rng = np.random.default_rng(0)
        hkv, dh, width = args.kv_heads, args.dh, (args.heads + 2 * args.kv_heads) * args.dh
        mask = np.zeros((1, 1, tokens, held + tokens), np.float32)
        for i in range(tokens):
            mask[0, 0, i, held + i + 1 :] = MASK_NEG
        slots = [[[0, h, held + i] for i in range(tokens)] for h in range(hkv)]
        angles = rng.standard_normal((1, tokens, dh // 2)).astype(np.float32)
        feeds = {
            "qkv": rng.standard_normal((tokens, width)).astype(np.float32),
            "cos": np.cos(angles),
            "sin": np.sin(angles),
            "slots": np.array([slots], np.int64),
            "mask": mask,
        }
        dtype = np.float16 if half else np.float32
        self.caches, self.bindings = [], []
        for _ in range(args.layers):
            k, v = (
                ort.OrtValue.ortvalue_from_numpy(
                    rng.standard_normal((1, hkv, CAPACITY, dh)).astype(dtype)
                )
                for _ in "kv"
            )
            io = self.session.io_binding()
            for name, x in feeds.items():
                io.bind_cpu_input(name, x)
            io.bind_ortvalue_input("past_k", k)
            io.bind_ortvalue_input("past_v", v)
            io.bind_ortvalue_output("k", k)  # in place, as the engine binds the cache
            io.bind_ortvalue_output("v", v)
            io.bind_output("y")
            self.caches.append((k, v))
            self.bindings.append(io)
        self.step()  # first-run allocations

    def step(self) -> tuple[float, float]:
        """One step through every layer: (wall ms, process CPU ms)."""
        w, c = time.perf_counter(), time.process_time()
        for io in self.bindings:
            self.session.run_with_iobinding(io)
        return 1e3 * (time.perf_counter() - w), 1e3 * (time.process_time() - c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dh", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    lib, info = kernel_library(), machine_info()
    print(
        f"{info.cpu} ({', '.join(info.cpu_flags)}), {info.cores} cores, load {info.load_average_1m}"
    )
    print(
        f"{args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, dh {args.dh}, "
        f"{args.threads} thread(s), kernels {lib.isa}, cache {CAPACITY} slots per layer"
    )
    runs = {(case, half): Layers(args, half, *case) for case in CASES for half in (False, True)}
    times: dict[tuple[tuple[int, int], bool], list[tuple[float, float]]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for case in CASES:
            for half in (False, True):
                steps = 5 if case[0] == 1 else 1
                samples = [runs[(case, half)].step() for _ in range(steps)]
                times[(case, half)].extend(samples)
    for case in CASES:
        f32 = [statistics.median(x) for x in zip(*times[(case, False)], strict=True)]
        f16 = [statistics.median(x) for x in zip(*times[(case, True)], strict=True)]
        print(
            f"{case[0]:3d} token(s) at {case[1]:5d} slots: f32 {f32[0]:7.2f} ms (CPU {f32[1]:7.2f})"
            f" | f16 {f16[0]:7.2f} ms (CPU {f16[1]:7.2f}) | f16/f32 {f16[0] / f32[0]:.2f}"
        )


if __name__ == "__main__":
    main()
