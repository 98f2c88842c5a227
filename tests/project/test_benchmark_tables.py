"""The benchmarks' arguments, tables and CPU dry runs: a formatting slip or a
stale API should fail here, not after minutes of GPU time. The tables'
headers must be the ones docs/benchmarks.md shows."""

import contextlib
import gc
import io
import json
import math
import os
import re
import weakref

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import keras_fp8  # noqa: F401 (registers the FP8 policies that test_arguments parses)
from benchmarks import keras_layer
from benchmarks import linear
from benchmarks import model
from benchmarks import quality
from benchmarks import quantize
from benchmarks import timing
from benchmarks import zoo
from tests.support.backend_utils import REPO
from tests.support.backend_utils import real_fp8_gemm

torch = pytest.importorskip("torch")

with open(os.path.join(REPO, "docs", "benchmarks.md")) as f:
    DOCS = f.read()


def _rows(text, header):
    """The table rows under `header` in `text` (up to the first blank line)."""
    lines = text.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _cols(line):
    return line.count("|")


def _run_worker(module, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.worker(module.parse_args(argv))
    return timing.parse_results(out.getvalue())


class TimingTest(parameterized.TestCase):
    def test_cells_and_ratios(self):
        self.assertEqual(timing.cell([2.0, 1.0, 3.0]), "2.000 [1.000-3.000]")
        self.assertEqual(timing.cell([2.0]), "2.000")
        self.assertEqual(timing.cell([None, float("nan")]), "-")
        # Ratios per process first: (4/2, 9/3) -> 2x and 3x.
        self.assertEqual(timing.ratio_cell([(4.0, 2.0), (9.0, 3.0)]), "2.50x [2.00-3.00]")

    def test_interleaved_medians_report_errors(self):
        def bad():
            raise ValueError("scaling: expected one of ('delayed', 'current'), got 'block'")

        out = timing.interleaved_medians({"ok": lambda: None, "bad": bad}, rounds=2, iters=2, warmup=1,
                                         timer=timing.wall_timer())
        self.assertIsInstance(out["ok"], float)
        self.assertIsInstance(out["bad"], ValueError)
        record = timing.variant_record("bad", out["bad"], shape="1x2x3")
        self.assertTrue(record["error"].startswith("ValueError: scaling"))

    def test_a_kept_failure_holds_no_frames(self):
        # An out-of-memory error kept with its traceback would keep the failed
        # variant's tensors alive (and fail every variant after it).
        class Tensor:
            pass

        watch = []

        def fail():
            held = Tensor()
            watch.append(weakref.ref(held))
            try:
                raise KeyError("inner")
            except KeyError as inner:
                raise MemoryError("out of memory") from inner

        try:
            fail()
        except MemoryError as e:
            kept = timing.failure(e)
        gc.collect()
        self.assertIsNone(watch[0]())
        self.assertIsNone(kept.__traceback__)
        self.assertIsNone(kept.__cause__.__traceback__)
        self.assertTrue(timing.variant_record("v", kept)["error"].startswith("MemoryError: out of memory"))

    def test_keras_wrapped_error(self):
        e = ValueError("Exception encountered when calling FP8Dense.call().\n\n\x1b[1mno block path\x1b[0m\n\n"
                       "Arguments received by FP8Dense.call():")
        self.assertEqual(timing.describe_error(e), "ValueError: no block path")

    def test_worker_argv(self):
        self.assertEqual(timing.worker_argv(["--processes", "3", "--json", "x.json", "--dry-run", "--processes=2"]),
                         ["--dry-run"])

    def test_parse_results(self):
        text = 'noise\nRESULT {"variant": "bf16", "ms": 1.5}\nRESULT {broken\n'
        self.assertEqual(timing.parse_results(text), [{"variant": "bf16", "ms": 1.5}])


def _linear_records(process, block_error=True):
    t = {"bf16": 8.0, "delayed": 4.0 + 0.1 * process, "current": 4.4, "torchao": 5.0}
    records = [{"env": {"gpu": "test GPU", "torch": "x"}}]
    for shape, gemms in (("16384x4096x14336", "fp8"), ("4096x1024x1024", "bf16")):
        for v in linear.VARIANTS:
            if v in t:
                records.append({"variant": v, "shape": shape, "ms": t[v], "ours_gemms": gemms})
            elif v == "block" and block_error:
                records.append({"variant": v, "shape": shape, "error": "ValueError: scaling"})
            else:
                records.append({"variant": v, "shape": shape, "skipped": "not importable: ModuleNotFoundError"})
    return records


class LinearTest(parameterized.TestCase):
    def test_headers_are_the_docs(self):
        self.assertIn(linear.RATIO_HEADER, DOCS)  # the ms table is printed, the page shows the ratios

    def test_tables(self):
        text = linear.tables([_linear_records(p) for p in range(3)])
        for header in (linear.MS_HEADER, linear.RATIO_HEADER):
            rows = _rows(text, header)
            self.assertLen(rows, 2)
            self.assertEqual([_cols(r) for r in rows], [_cols(header)] * 2)
        ratio_rows = _rows(text, linear.RATIO_HEADER)
        # delayed: 8 / (4.0, 4.1, 4.2) -> median 1.95x, range 1.90-2.00.
        self.assertIn("| 1.95x [1.90-2.00] |", ratio_rows[0])
        self.assertIn("n/a (error: ValueError: scaling)", ratio_rows[0])
        self.assertIn("n/a (not importable: ModuleNotFoundError)", ratio_rows[0])
        self.assertTrue(ratio_rows[1].startswith("| 4096 x 1024 x 1024 (bf16 GEMMs) |"))

    def test_arguments(self):
        args = linear.parse_args([])
        self.assertEqual(args.processes, 3)
        self.assertEqual(args.shape_list[:3], [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)])
        self.assertIn((8192, 4096, 4096), args.shape_list)
        self.assertFalse(args.graphs)
        with self.assertRaises(SystemExit):
            linear.parse_args(["--variants", "bf16,nope"])

    def test_dry_run_worker(self):
        records = _run_worker(linear, ["--dry-run", "--shapes", "32x64x128"])
        by_variant = {r["variant"]: r for r in records if "variant" in r}
        self.assertGreater(by_variant["bf16"]["ms"], 0)
        self.assertGreater(by_variant["delayed"]["ms"], 0)
        self.assertGreater(by_variant["current"]["ms"], 0)
        self.assertIn("block", by_variant)  # a time once block scaling lands, an error until then
        self.assertEqual(by_variant["torchao"]["skipped"], "GPU only")
        text = linear.tables([records])
        self.assertLen(_rows(text, linear.MS_HEADER), 1)


class QuantizeTest(parameterized.TestCase):
    def test_dry_run_worker_and_table(self):
        records = _run_worker(quantize, ["--dry-run"])
        by_variant = {r["variant"]: r for r in records if "variant" in r}
        self.assertEqual(set(by_variant), set(quantize.VARIANTS))
        self.assertGreater(by_variant["delayed_t"]["tbps"], 0)
        self.assertEqual(by_variant["delayed_t"]["bytes"], 256 * 256 * 4)
        text = quantize.tables([records, records])
        self.assertIn(quantize.HEADER, DOCS)
        rows = _rows(text, quantize.HEADER)
        self.assertLen(rows, len(quantize.VARIANTS))
        self.assertEqual({_cols(r) for r in rows}, {_cols(quantize.HEADER)})


def _layer_records(backend, p):
    records = []
    for v, ms in (("dense_bf16", 9.0), ("fp8_delayed", 5.0), ("fp8_current", 5.5)):
        records.append({"variant": v, "row": f"{backend} 16384x4096x14336", "ms": ms + 0.1 * p,
                        "mem_gib": 2.0 if v == "dense_bf16" else 1.5})
    records.append({"variant": "fp8_block", "row": f"{backend} 16384x4096x14336", "error": "ValueError: x"})
    return records


class KerasLayerTest(parameterized.TestCase):
    def test_tables(self):
        per_process = [_layer_records("torch", p) + _layer_records("jax", p) for p in range(3)]
        text = keras_layer.tables(per_process)
        for header in (keras_layer.HEADER, keras_layer.MEM_HEADER):
            self.assertIn(header, DOCS)
            rows = _rows(text, header)
            self.assertLen(rows, 2)
            self.assertEqual({_cols(r) for r in rows}, {_cols(header)})
        self.assertIn("| 0.75x [0.75-0.75] |", _rows(text, keras_layer.MEM_HEADER)[0])

    def test_dry_run_worker(self):
        # Under JAX each variant compiles: the bf16 one only under torch.
        variants = "fp8_delayed,fp8_block" if keras.backend.backend() == "jax" else "dense_bf16,fp8_delayed,fp8_block"
        records = _run_worker(keras_layer, ["--dry-run", "--variants", variants])
        by_variant = {r["variant"]: r for r in records if "variant" in r}
        self.assertGreater(by_variant["fp8_delayed"]["ms"], 0)
        self.assertIn("mem_gib", by_variant["fp8_delayed"] if keras.backend.backend() == "jax" else {"mem_gib": 0})
        self.assertIn("fp8_block", by_variant)
        self.assertEqual(by_variant["fp8_delayed"]["row"], f"{keras.backend.backend()} 64x128x256")

    def test_jax_step_computes_the_forward_product(self):
        # An unused y would let XLA drop the forward GEMM from the timed step.
        if keras.backend.backend() != "jax":
            self.skipTest("the JAX step")
        layers = {"dense_bf16": keras_layer.make_layer("dense_bf16", 128, 256)}
        _, compiled = keras_layer._jax_steps(layers, 64, 128, 256)
        text = compiled["dense_bf16"]().as_text()
        # A dot on the CPU; a cuBLAS call (or a fused dot) on a GPU.
        self.assertLen(re.findall(r'\bdot\(|custom_call_target="__cublas', text), 3)

    @parameterized.parameters(True, False)
    def test_steps_fill_the_gradient_history(self, overwrite):
        # As in fit, the gradient channel takes its gradient after each step,
        # so the output gradient's history records (an empty one would make
        # every gradient quantize seed its scale with an extra pass);
        # --no-overwrite leaves it empty. The layer runs FP8 at this small
        # size on every device (on a GPU it would run the compute dtype).
        layer = keras_layer.make_layer("fp8_delayed", 128, 256)
        layer.min_gemm_size = 0
        if keras.backend.backend() == "jax":
            steps, _ = keras_layer._jax_steps({"fp8_delayed": layer}, 64, 128, 256, overwrite)
            model_state = None
            for _ in range(3):
                model_state = steps["fp8_delayed"]()[2]
            by_path = dict(zip([v.path for v in layer.non_trainable_variables], model_state))
            history = by_path[layer.grad_amax_history.path]
        else:
            steps = keras_layer._torch_steps({"fp8_delayed": layer}, 64, 128, 256, overwrite)
            for _ in range(3):
                steps["fp8_delayed"]()
            history = layer.grad_amax_history.value
        history = keras.ops.convert_to_numpy(history)
        self.assertEqual(layer.fp8_execution()[0], "FP8")
        if overwrite:
            self.assertGreater(history[0], 0)
            self.assertGreater(history[1], 0)
        else:
            self.assertEqual(float(history.max()), 0.0)


def _model_records(p):
    rows = [("keras-torch", "mixed_bfloat16", 250.0), ("keras-torch", "mixed_bfloat16+shortcut", 240.0),
            ("keras-torch", "fp8_hybrid", 190.0 + p), ("torch", "torch-bf16", 160.0),
            ("torch", "torchao", 120.0), ("keras-jax", "mixed_bfloat16", 150.0), ("keras-jax", "fp8_hybrid", 100.0)]
    out = [{"variant": v, "row": r, "ms": ms, "tok_per_s": 16384 / ms * 1e3, "mem_gib": 20.0} for r, v, ms in rows]
    out.append({"variant": "fp8_hybrid+monitor", "row": "keras-torch",
                "skipped": "keras_fp8.callbacks.FP8Monitor not available"})
    return out


class ModelTest(parameterized.TestCase):
    def test_arguments(self):
        args = model.parse_args([])
        self.assertEqual((args.hidden, args.mlp, args.heads, args.blocks, args.seq, args.batch, args.vocab),
                         (4096, 14336, 32, 4, 2048, 8, 32000))
        self.assertEqual(args.policy_list, ["mixed_bfloat16", "fp8_hybrid"])
        small = model.parse_args(["--size", "small", "--seq", "256"])
        self.assertEqual((small.hidden, small.seq), (1024, 256))
        self.assertEqual(model.keras_variants(model.parse_args(["--monitor"]), "torch"),
                         ["mixed_bfloat16", "mixed_bfloat16+shortcut", "fp8_hybrid", "fp8_hybrid+monitor"])
        self.assertEqual(model.keras_variants(model.parse_args([]), "jax"), ["mixed_bfloat16", "fp8_hybrid"])
        with self.assertRaises(SystemExit):
            model.parse_args(["--policies", "fp8_hybrid,mixed_bfloat16"])

    def test_tables(self):
        text = model.tables([_model_records(p) for p in range(3)])
        self.assertIn(model.HEADER, DOCS)
        rows = _rows(text, model.HEADER)
        self.assertLen(rows, 8)
        self.assertEqual({_cols(r) for r in rows}, {_cols(model.HEADER)})
        ratios = "\n".join(_rows(text, model.RATIO_HEADER))
        self.assertIn("fp8_hybrid over mixed_bfloat16 with the shortcut (FP8's share) | 1.26x [1.25-1.26] |", ratios)
        self.assertIn("torchao over bf16 | 1.33x [1.33-1.33] |", ratios)
        self.assertIn("n/a (keras_fp8.callbacks.FP8Monitor not available)", text)

    def test_monitor_rows(self):
        # Per process: four timed steps per fit, one of them measuring; the
        # means put 4 x 5 = 20 ms on that measurement.
        records = []
        for p in range(3):
            records.append([{"variant": "fp8_hybrid", "row": "keras-jax", "ms": 100.0, "ms_mean": 100.0,
                             "timed_per_fit": 4},
                            {"variant": "fp8_hybrid+monitor", "row": "keras-jax", "ms": 100.0 + p,
                             "ms_mean": 105.0, "timed_per_fit": 4, "every_n_steps": 50,
                             "measurements": 3, "measure_ms": 19.0 + p, "measure_ms_max": 30.0 + p}])
        ratios = "\n".join(_rows(model.tables(records), model.RATIO_HEADER))
        self.assertIn("a step it does not measure (step time with it over without, medians) | 1.01x [1.00-1.02] |",
                      ratios)
        self.assertIn("one measurement with a probe batch (extra ms of a fit's timed steps) | 20.0 [20.0-20.0] |",
                      ratios)
        # 20 ms over 50 steps of 100 ms.
        self.assertIn("every_n_steps=50 (one measurement over 50 steps), % of the step time | 0.4% [0.4-0.4] |",
                      ratios)
        self.assertIn("one measurement timed directly (FP8Monitor.measure, median ms) | 20.0 [19.0-21.0] |", ratios)
        self.assertIn("the slowest timed measurement (ms) | 31.0 [30.0-32.0] |", ratios)

    def test_monitor_measurements_are_timed_in_the_timed_fits(self):
        # The tiny decoder, two rounds: one measurement per fit, the
        # warm-up's left out, each timed.
        if keras.backend.backend() != "torch":
            self.skipTest("one backend is enough for the worker's bookkeeping")
        records = _run_worker(model, ["--size", "tiny", "--rounds", "2", "--steps", "3", "--warmup", "1",
                                      "--backends", "torch", "--monitor", "--peers", "none", "--no-shortcut-ablation"])
        watched = [r for r in records if r.get("variant") == "fp8_hybrid+monitor"]
        self.assertLen(watched, 1)
        self.assertEqual(watched[0]["measurements"], 2)
        self.assertGreater(watched[0]["measure_ms"], 0)
        self.assertGreaterEqual(watched[0]["measure_ms_max"], watched[0]["measure_ms"])

    def test_shortcut_dense_matches_dense(self):
        if keras.backend.backend() != "torch":
            self.skipTest("the shortcut is the torch backend's")
        cls = model.shortcut_dense_class()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        layer = cls(16, use_bias=False)
        layer.build((None, 8))
        x = torch.randn(4, 8, dtype=torch.bfloat16, device=layer.kernel.value.device)
        plain = layer(x)
        cls.enabled = True
        try:
            fast = layer(x)
        finally:
            cls.enabled = False
        self.assertEqual(fast.dtype, plain.dtype)
        torch.testing.assert_close(fast, plain, rtol=0, atol=0)


def _zoo_records(p):
    row = "llama/large/keras-torch"
    out = [{"env": {"gpu": "H100", "torch": "2.13"}}]
    for v, ms in (("mixed_bfloat16", 300.0 + p), ("fp8_hybrid", 200.0), ("keras_float8", 250.0)):
        out.append({"variant": v, "row": row, "ms": ms, "tok_per_s": 8192 / ms * 1e3, "mem_gib": 10.0,
                    "resident_gib": 20.0, "peak_gib": 30.0, "warmup_s": 12.0})
    out.append({"variant": "fp8_hybrid+compiled", "row": row,
                "error": "VariantTimeout: fp8_hybrid+compiled fit: no result within 120 s"})
    for v, ms in (("mixed_bfloat16+blocks", 240.0), ("fp8_hybrid+blocks", 150.0)):
        out.append({"variant": v, "row": row, "ms": ms, "tok_per_s": 8192 / ms * 1e3, "warmup_s": 60.0,
                    "recompiles": 0})
    out.append({"variant": "torch-bf16", "row": "llama/large/torch", "ms": 150.0, "tok_per_s": 1.0})
    out.append({"variant": "torchao", "row": "llama/large/torch", "ms": 120.0, "tok_per_s": 1.0})
    categories = dict.fromkeys(zoo.CATEGORY_NAMES, 10.0)
    for policy in ("mixed_bfloat16", "fp8_hybrid"):
        out.append({"profile": {"wall_ms": 300.0, "categories": categories, "top": []}, "row": row, "of": policy})
    out.append({"roofline": True, "row": row, "shapes": [], "gemm_plain_ms": 120.0, "gemm_fp8_ms": 60.0,
                "rest_ms": 180.0 + p, "roofline_ms": 240.0 + p, "fp8_ms": 200.0, "fraction": (240.0 + p) / 200.0})
    out.append({"roofline": True, "row": "llama/large/keras-jax", "shapes": [], "skipped": "GPU only"})
    out.append({"variant": "fp8_hybrid", "row": row + "/max-batch", "max_batch": 12 + p, "capped": False})
    return out


class ZooTest(parameterized.TestCase):
    def test_arguments(self):
        args = zoo.parse_args([])
        self.assertEqual((args.model_list, args.size_list), (["llama"], ["large"]))
        cfg = zoo.config(args, "llama", "large")
        self.assertEqual((cfg.layers, cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.vocab, cfg.seq, cfg.batch),
                         (4, 4096, 14336, 32, 8, 32000, 2048, 4))
        self.assertEqual(zoo.config(zoo.parse_args(["--seq", "1024"]), "gpt2", "small").seq, 1024)
        self.assertEqual(zoo.keras_variants(args, "torch"),
                         ["mixed_bfloat16", "fp8_hybrid", "keras_float8", "mixed_bfloat16+compiled",
                          "fp8_hybrid+compiled"])
        self.assertEqual(zoo.keras_variants(args, "jax"), ["mixed_bfloat16", "fp8_hybrid", "keras_float8"])
        self.assertEqual(zoo.parse_args(["--dry-run"]).size_list, ["tiny"])
        some = zoo.parse_args(["--variants", "fp8_hybrid+blocks,mixed_bfloat16,torchao,fp8_hybrid+moments"])
        self.assertEqual(zoo.keras_variants(some, "torch"),
                         ["mixed_bfloat16", "fp8_hybrid+blocks", "fp8_hybrid+moments"])
        self.assertEqual(zoo.keras_variants(some, "jax"), ["mixed_bfloat16", "fp8_hybrid+moments"])
        self.assertEqual(zoo.peer_variants(some, "torch", cfg), ["torchao"])
        self.assertEqual(zoo.peer_variants(some, "jax", cfg), [])
        self.assertEqual(zoo.parse_variant("fp8_hybrid+blocks+moments"), ("fp8_hybrid", "blocks", True))
        self.assertEqual(zoo.parse_variant("keras_float8"), ("mixed_bfloat16", "eager", False))
        self.assertEqual(zoo.label("mixed_bfloat16+compiled"), "mixed_bfloat16, jit_compile=True")
        for bad in (["--models", "llama,t5"], ["--sizes", "huge"], ["--steps", "1"], ["--compile-budget", "0"],
                    ["--variants", "fp8_hybrid,bf16"]):
            with self.assertRaises(SystemExit):
                zoo.parse_args(bad)
        for name in zoo.MODELS:  # every size is a valid attention layout
            for size in zoo.SIZES[name]:
                zoo.config(args, name, size)

    def test_categories(self):
        self.assertEqual(zoo.categorize("sm90_xmma_gemm_e4m3e4m3_bf16_tn"), "FP8 GEMMs")
        self.assertEqual(zoo.categorize("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"), "other GEMMs")
        self.assertEqual(zoo.categorize("void quantize_kernel<__nv_fp8_e4m3>(...)"), "quantize")
        self.assertEqual(zoo.categorize("flash_fwd_kernel<Flash_fwd_kernel_traits>"), "attention")
        self.assertEqual(zoo.categorize("cunn_SpatialSoftMaxForward<float>"), "loss")
        self.assertEqual(zoo.categorize("multi_tensor_apply_kernel<FusedAdamMathFunctor>"), "optimizer")
        self.assertEqual(zoo.categorize("vectorized_elementwise_kernel<mul>"), "norms and element-wise")

    def test_tables(self):
        text = zoo.tables([_zoo_records(p) for p in range(3)])
        rows = _rows(text, zoo.HEADER)
        self.assertLen(rows, 8)
        self.assertEqual({_cols(r) for r in rows}, {_cols(zoo.HEADER)})
        self.assertIn("| llama (large) | Keras, torch backend | fp8_hybrid | 200.0 [200.0-200.0] | 40960 [40960-40960] "
                      "| 1.50x [1.50-1.51] | 1.25x [1.25-1.25] | 10.00 [10.00-10.00] | 30.00 [30.00-30.00] "
                      "| 12 [12-12] | - |", text)
        self.assertIn("n/a (error: VariantTimeout: fp8_hybrid+compiled fit: no result within 120 s)", text)
        # ours 150 ms against torchao's 120 and bf16's 240 under the same compile
        self.assertEqual(_rows(text, zoo.COMPILED_HEADER),
                         ["| llama (large) | fp8_hybrid, compile_blocks and compile_optimizer | 150.0 [150.0-150.0] | 1.60x [1.60-1.60] "
                          "| 120.0 [120.0-120.0] | 0.80x [0.80-0.80] |"])
        profile = _rows(text, zoo.PROFILE_HEADER)
        self.assertLen(profile, len(zoo.CATEGORY_NAMES) + 1)
        roofline = _rows(text, zoo.ROOFLINE_HEADER)
        self.assertIn("| 120.0 [120.0-120.0] | 60.0 [60.0-60.0] | 181.0 [180.0-182.0] | 241.0 [240.0-242.0] "
                      "| 200.0 [200.0-200.0] | 120% [120-121] |", roofline[0])
        self.assertIn("n/a (GPU only)", roofline[1])
        self.assertEqual(_rows(text, zoo.MAX_BATCH_HEADER), ["| llama (large) | Keras, torch backend | fp8_hybrid "
                                                             "| 13 [12-14] |"])

    def test_dry_run_worker(self):
        # The tiny Llama on the CPU: every Keras variant, the compiled ones
        # cut off by their budget (recorded, the run goes on).
        if keras.backend.backend() != "torch":
            self.skipTest("one backend is enough for the worker's bookkeeping (JAX compiles each variant)")
        records = _run_worker(zoo, ["--dry-run", "--compile-budget", "0.2"])
        by_variant = {r["variant"]: r for r in records if "variant" in r}
        for name in ("mixed_bfloat16", "fp8_hybrid", "keras_float8"):
            self.assertGreater(by_variant[name]["ms"], 0, name)
            self.assertTrue(math.isfinite(by_variant[name]["loss_last"]), name)
        for name in ("mixed_bfloat16+compiled", "fp8_hybrid+compiled"):
            self.assertIn("no result within 0 s", by_variant[name]["error"])
        self.assertEqual(by_variant["torchao"]["skipped"], "GPU only")
        roofline = [r for r in records if "roofline" in r]
        self.assertEqual(roofline[0]["skipped"], "GPU only")
        # The FP8 layers' GEMMs, the vocabulary projection's flagged. Where
        # real FP8 GEMMs run, the tiny model's GEMMs are below min_gemm_size
        # and run the compute dtype: none is recorded.
        expected = [] if real_fp8_gemm() else [[64, 64, 256, True, 1]]
        self.assertEqual([s for s in roofline[0]["shapes"] if s[3]], expected)
        self.assertIn("| llama (tiny) |", zoo.tables([records]))


def _run_result(v):
    """A quality run's result whose final (and only) evaluation reads v."""
    curve = [{"step": 0, "val": 5.5}, {"step": 3, "train": v, "val": v}]
    return {"policy": "p", "curve": curve, "final_train": v, "final_val": v, "nonfinite": 0, "skipped": 0,
            "ms_per_step": 1.0}


class QualityTest(parameterized.TestCase):
    def test_arguments(self):
        args = quality.parse_args(["--size", "cpu"])
        self.assertEqual((args.hidden, args.layers, args.seq, args.corpus), (128, 2, 128, "docs"))
        self.assertEqual(quality.parse_args(["--size", "gpu"]).corpus, "stdlib")
        self.assertEqual(quality.parse_args(["--dry-run"]).size, "tiny")
        with self.assertRaises(SystemExit):
            quality.parse_args(["--recipes", "bf16,fp4"])
        for policy in quality.RECIPES.values():  # every policy name parses
            keras.dtype_policies.get(policy)

    def test_fp8_moments_flag(self):
        self.assertFalse(quality.parse_args(["--dry-run"]).fp8_moments)
        self.assertTrue(quality.parse_args(["--dry-run", "--fp8-moments"]).fp8_moments)
        with_moments = dict(_run_result(2.02), fp8_moments=True)
        rows = _rows(quality.table({"bf16": _run_result(2.0), "delayed": with_moments}), quality.HEADER)
        self.assertIn("| `p` + FP8 moments | 2.0200 |", rows[1])
        self.assertIn("| +1.00% |", rows[1])
        self.assertNotIn("FP8 moments", rows[0])

    def test_data_is_fixed_and_split(self):
        text, source = quality.corpus_bytes("docs")
        self.assertGreater(len(text), 10**6)
        self.assertIn("python_docs.txt", source)
        train, val = quality.split(text)
        self.assertEqual(len(train) + len(val), len(text))
        args = quality.parse_args(["--dry-run"])
        a = quality.batches(args, train, val)
        b = quality.batches(args, train, val)
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
        x, y, xv, yv = a
        self.assertEqual(x.shape, (args.steps * args.batch, args.seq))
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        self.assertEqual(xv.shape, (args.val_windows, args.seq))

    def test_gaps_and_table(self):
        def result(scale, nonfinite=0):
            curve = [{"step": 0, "val": 5.5}] + [{"step": s, "train": 2.0 * scale + 1 / s, "val": 2.1 * scale}
                                                 for s in (10, 20)]
            return {"policy": "p", "curve": curve, "final_train": curve[-1]["train"], "final_val": curve[-1]["val"],
                    "nonfinite": nonfinite, "skipped": 0, "ms_per_step": 3.0}

        results = {"bf16": result(1.0), "delayed": result(1.005), "current": result(0.99, nonfinite=2),
                   "block": {"policy": "p", "error": "ValueError: no block path"}}
        g = quality.gaps(results["delayed"], results["bf16"])
        self.assertAlmostEqual(g["gap_val"], 0.005)
        self.assertAlmostEqual(g["max_gap_val"], 0.005)
        self.assertTrue(math.isfinite(g["max_gap_train"]))
        text = quality.table(results)
        self.assertIn(quality.HEADER, DOCS)
        rows = _rows(text, quality.HEADER)
        self.assertLen(rows, 4)
        self.assertEqual({_cols(r) for r in rows}, {_cols(quality.HEADER)})
        self.assertIn("| +0.50% |", rows[1])
        self.assertIn("| -1.00% |", rows[2])
        self.assertIn("n/a (error: ValueError: no block path)", rows[3])

    def test_json_is_rewritten_whole_after_each_recipe(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            args = quality.parse_args(["--dry-run", "--json", os.path.join(d, "q.json")])
            for results in ({"bf16": {"final_val": 2.0}}, {"bf16": {"final_val": 2.0}, "delayed": {"final_val": 2.1}}):
                quality.save_json(args, {"gpu": "none"}, 10, "docs", results)
                with open(args.json) as f:
                    saved = json.load(f)
                self.assertEqual(saved["results"], results)
                self.assertEqual(saved["args"]["size"], "tiny")
            self.assertEqual(os.listdir(d), ["q.json"])

    def test_from_json_merges_runs_of_one_size_and_seed(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            a, b, c, merged = (os.path.join(d, n) for n in ("a.json", "b.json", "c.json", "m.json"))
            args = quality.parse_args(["--dry-run", "--json", a])
            quality.save_json(args, {"gpu": "none"}, 10, "docs",
                              {"bf16": _run_result(2.0), "delayed": _run_result(2.02)})
            args.json = b
            quality.save_json(args, {"gpu": "none"}, 10, "docs", {"bf16": _run_result(2.0), "block": _run_result(2.01)})
            args.json, args.seed = c, 1
            quality.save_json(args, {"gpu": "none"}, 10, "docs", {"current": _run_result(2.0)})
            with contextlib.redirect_stdout(io.StringIO()) as out:
                results = quality.main(["--from-json", f"{b},{a}", "--json", merged])
            self.assertEqual(list(results), ["bf16", "delayed", "block"])
            self.assertIn("| +1.00% |", out.getvalue())  # delayed over bf16
            with open(merged) as f:
                self.assertEqual(json.load(f)["results"], results)
            with self.assertRaisesRegex(SystemExit, "c.json was run with other \\['seed'\\]"):
                quality.main(["--from-json", f"{a},{c}"])

    def test_across_seeds_gives_each_seed_and_the_mean(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            a, b, c = (os.path.join(d, n) for n in ("a.json", "b.json", "c.json"))
            args = quality.parse_args(["--dry-run", "--json", a])
            quality.save_json(args, {"gpu": "none"}, 10, "docs",
                              {"bf16": _run_result(2.0), "delayed": _run_result(2.02), "block": _run_result(2.01)})
            args.json, args.seed = b, 1
            quality.save_json(args, {"gpu": "none"}, 10, "docs",
                              {"bf16": _run_result(2.0), "delayed": _run_result(1.98), "current": _run_result(2.0)})
            with contextlib.redirect_stdout(io.StringIO()) as out:
                quality.main(["--across-seeds", f"{a},{b}"])
            rows = {r.split("|")[1].strip(): r for r in out.getvalue().splitlines()[2:]}
            self.assertEqual(list(rows), ["delayed", "current", "block"])
            self.assertIn("| +1.00% | -1.00% | +0.00% | 2 |", rows["delayed"])
            self.assertIn("| n/a | +0.00% | +0.00% | 1 |", rows["current"])
            self.assertIn("| +0.50% | n/a | +0.50% | 1 |", rows["block"])
            with self.assertRaisesRegex(SystemExit, "repeats seed 0"):
                quality.main(["--across-seeds", f"{a},{a}"])
            with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
                quality.parse_args(["--from-json", a, "--across-seeds", b])
            self.assertIn("--from-json, --across-seeds: one at a time", err.getvalue())
            args.json, args.seed, args.steps = c, 2, 9
            quality.save_json(args, {"gpu": "none"}, 10, "docs", {"bf16": _run_result(2.0)})
            with self.assertRaisesRegex(SystemExit, "c.json was run with other \\['steps'\\]"):
                quality.main(["--across-seeds", f"{a},{c}"])

    def test_plot(self):
        pytest.importorskip("matplotlib")
        import tempfile

        curve = [{"step": 0, "val": 5.5}, {"step": 3, "train": 3.0, "val": 2.9}, {"step": 6, "train": 2.5, "val": 2.4}]
        results = {"bf16": {"curve": curve}, "delayed": {"curve": curve},
                   "block": {"error": "ValueError: no block path"}}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "q.png")
            quality.plot(results, quality.parse_args(["--dry-run"]), path)
            self.assertGreater(os.path.getsize(path), 1000)

    def test_model_builds(self):
        if keras.backend.backend() != "torch":
            self.skipTest("backend-agnostic model code, built once (symbolic builds take seconds under JAX)")
        args = quality.parse_args(["--dry-run"])
        m = quality.build_model(args, quality.RECIPES["delayed"])
        self.assertEqual(tuple(m.output.shape), (None, args.seq, 256))
        # 5 FP8 projections per block, each with its FP8 state.
        fp8 = [layer for layer in m._flatten_layers() if type(layer).__name__ == "FP8Dense"]
        self.assertLen(fp8, 5 * args.layers)
        self.assertEqual(m.optimizer.global_clipnorm, 1.0)
        keras.backend.clear_session()


def test_jax_fp8_dot_probe_dry_run():
    # tools/jax_fp8_dot_probe.py on the CPU at its tiny shape (Keras on JAX, a
    # process of its own): every way compiles, is compared with the emulation
    # and timed.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "jax_fp8_dot_probe.py"), "--dry-run",
                           "--ways", "bf16,scale_after,dequant_f32"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for way in ("bf16", "scale_after", "dequant_f32"):
        assert f"64x128x256 {way}: custom calls" in done.stdout
        assert re.search(rf"64x128x256 {way}: [0-9.]+ ms", done.stdout)
    assert "once-rounded" in done.stdout
    bad = subprocess.run([sys.executable, os.path.join(root, "tools", "jax_fp8_dot_probe.py"), "--ways", "fp4"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ways: expected names from" in bad.stderr


def test_decoder_profile_dry_run(tmp_path):
    # tools/decoder_profile.py at the tiny decoder, a process of its own, with
    # a stand-in nvidia-smi printing two samples (a CPU has no kernel rows).
    import subprocess
    import sys

    if keras.backend.backend() != "torch":
        pytest.skip("backend-agnostic tool logic, run once (under torch)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '1545, 674.5, 51, 0x0000000000000004'\n"
                   "echo '1860, 562.9, 49, 0x0000000000000004'\nexec sleep 60\n")
    smi.chmod(0o755)
    env = dict(os.environ, KERAS_BACKEND="torch", PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    tool = os.path.join(root, "tools", "decoder_profile.py")
    done = subprocess.run([sys.executable, tool, "--dry-run", "--policies", "fp8_hybrid", "--fits", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"=== torch decoder, fp8_hybrid: step [0-9.]+ ms \(median\)", done.stdout)
    assert ("clocks: 2 samples, SM clock median 1702 MHz [1545-1860], power median 619 W (max 674), "
            "temperature max 51 C, clock event reasons 0x0000000000000004 in 2") in done.stdout
    bad = subprocess.run([sys.executable, tool, "--fits", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--fits: expected a positive integer, got 0" in bad.stderr
