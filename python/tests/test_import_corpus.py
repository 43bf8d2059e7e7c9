"""tools/import_corpus.py's own logic, without torch: the device's rows merged into the CPU ones,
what passes, where torch.compile is timed, argmax agreement, and a run's budget."""

import json
import os
import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import import_corpus as ic  # noqa: E402


def cpu_row(model, status="pass"):
    return {"model": model, "source": "timm", "size": 64, "status": status, "commit": "abc", "cpu_b2": [1e-7, 1e-8],
            "cpu_b3": [1e-7, 1e-8], "time_s": 3}


def gpu_row(model, status="pass", kiln=1.0, torch=1.5, transformer=False):
    return {"model": model, "source": "timm", "size": 64, "status": status, "commit": "def",
            "gpu": {"status": status, "fp32": [1e-6, 1e-7], "fp16": 1e-3, "torch_fp16": 1e-3, "fp16_agree": 1.0,
                    "torch_fp16_agree": 1.0, "kiln_ms": {"1": kiln, "16": kiln * 4}, "torch_graph_ms": {"1": torch, "16": torch * 4},
                    "transformer": transformer, "device": "NVIDIA H200", "commit": "def"}}


class ImportCorpus(unittest.TestCase):
    def test_device_rows_join_the_cpu_rows_and_count_only_when_both_pass(self):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            (d / "cpu.json").write_text(json.dumps({"gpu": False, "models": [cpu_row("timm/a"), cpu_row("timm/b"), cpu_row("timm/c")]}))
            (d / "dev.json").write_text(json.dumps({"gpu": True, "models": [
                gpu_row("timm/a"), gpu_row("timm/b", status="fail"),
                {"model": "timm/c", "source": "timm", "size": 64, "status": "unsupported", "reason": "aten.x at m: why",
                 "commit": "def"}]}))
            # A device row from an older build stays in the table but not in the count.
            old_row = gpu_row("timm/d")
            old_row["gpu"]["commit"] = "abc"
            (d / "old.json").write_text(json.dumps({"gpu": True, "models": [cpu_row("timm/d"), old_row]}))
            (d / "comp.json").write_text(json.dumps({"gpu": True, "models": [
                {"model": "timm/a", "source": "timm", "size": 64, "compile": {"status": "pass", "compile_ms": {"1": 0.9, "16": 3.0}}}]}))
            doc = d / "IMPORT.md"
            doc.write_text(f"before\n{ic.SUMMARY_BEGIN}\nold\n{ic.SUMMARY_END}\nafter\n")
            entries = [ic.Entry(m, "timm", 64) for m in ("timm/a", "timm/b", "timm/c", "timm/d")]
            old = ic.write_summary.__defaults__
            ic.write_summary.__defaults__ = (doc,)
            try:
                ic.merge([d / "cpu.json", d / "dev.json", d / "old.json", d / "comp.json"], entries, d / "out.json", d / "out.md")
                # A later CPU run keeps the device's results.
                (d / "cpu2.json").write_text(json.dumps({"gpu": False, "models": [cpu_row("timm/a")]}))
                ic.merge([d / "out.json", d / "cpu2.json"], entries, d / "out2.json", d / "out2.md")
            finally:
                ic.write_summary.__defaults__ = old
            rows = {r["model"]: r for r in json.loads((d / "out2.json").read_text())["models"]}
            self.assertEqual(rows["timm/a"]["gpu"]["status"], "pass")
            self.assertEqual(rows["timm/a"]["compile"]["compile_ms"]["1"], 0.9)
            self.assertEqual(rows["timm/b"]["gpu"]["status"], "fail")
            self.assertIn("export on the device", rows["timm/c"]["gpu"]["reason"])
            table = (d / "out2.md").read_text()
            self.assertIn("Corpus: 1 of 3 models import and match.", table)
            self.assertIn("1 model is not yet checked on the device at def and left out of the count", table)
            self.assertIn("## Not yet checked on the device at def\n\ntimm/d.\n", table)
            self.assertIn("The CPU alone: 4 of 4.", table)
            self.assertIn("| 0.900 / 3.000 |", table)
            text = doc.read_text()
            self.assertTrue(text.startswith("before\n") and text.endswith("after\n") and "old" not in text)
            self.assertIn("Corpus: 1 of 3 models import and match.", text)

    def test_the_layout_copies_are_read_from_kiln_inspect_and_shown(self):
        text = "graph: 12 nodes\n48 layout copies planned (a value read in another layout than it is stored in):\n  a <- b\n"
        self.assertEqual(ic.LAYOUT_COPIES.search(text).group(1), "48")
        self.assertIsNone(ic.LAYOUT_COPIES.search("no engine"))
        with tempfile.TemporaryDirectory() as d:
            fake = Path(d) / "kiln"
            fake.write_text("#!/bin/sh\necho '0 layout copies planned (a value read in another layout than it is stored in)'\n")
            fake.chmod(0o755)
            self.assertEqual(ic.layout_copies(str(fake), Path(d) / "m.kiln.safetensors", 10), 0)
            fake.write_text("#!/bin/sh\necho 'error: no such file' >&2\nexit 1\n")
            self.assertIsNone(ic.layout_copies(str(fake), Path(d) / "m.kiln.safetensors", 10))
        rows = [dict(cpu_row("timm/a"), layout_copies=24), dict(cpu_row("timm/b"), layout_copies=0), dict(cpu_row("timm/c"), layout_copies=96)]
        table = ic.render(rows, False)
        self.assertIn("| 24 |", table)
        self.assertIn("1 of 3 models plan none; the 2 with the most", table)
        self.assertIn("timm/c 96, timm/a 24.", table)

    def test_torch_compile_is_timed_for_transformers_and_leads_under_1_2(self):
        self.assertTrue(ic.needs_compile(gpu_row("m", kiln=1.0, torch=1.1)["gpu"]))
        self.assertFalse(ic.needs_compile(gpu_row("m", kiln=1.0, torch=1.5)["gpu"]))
        self.assertTrue(ic.needs_compile(gpu_row("m", kiln=1.0, torch=1.5, transformer=True)["gpu"]))
        self.assertFalse(ic.needs_compile({}))

    def test_a_profile_is_kept_by_kind_and_slowest_layers(self):
        layers = [{"index": i, "path": f"blocks.{i}", "kind": kind, "time_ms": ms, "share": 0.0}
                  for i, (kind, ms) in enumerate([("kernel:layer_norm_rows", 0.01), ("kernel:gemm_x:split2", 0.03),
                                                  ("kernel:concat_channels(x3)", 0.02), ("kernel:layer_norm_rows", 0.02),
                                                  ("cublaslt-gemm", 0.05), ("kernel:gemm_x:split4", 0.01)])]
        p = ic.profile_summary(layers)
        self.assertAlmostEqual(p["sum_ms"], 0.14)
        self.assertEqual(p["layers"], 6)
        self.assertEqual([(k["kind"], k["layers"], k["ms"]) for k in p["by_kind"]],
                         [("cublaslt-gemm", 1, 0.05), ("kernel:gemm_x", 2, 0.04), ("kernel:layer_norm_rows", 2, 0.03),
                          ("kernel:concat_channels", 1, 0.02)])
        self.assertEqual([l["path"] for l in p["slowest"]], ["blocks.4", "blocks.1", "blocks.2", "blocks.3", "blocks.0"])

    def test_a_model_pytorch_cannot_graph_is_timed_eagerly_and_compiled(self):
        row = gpu_row("m", kiln=1.0, torch=1.5)
        g = row["gpu"]
        del g["torch_graph_ms"]
        g.update(torch_graph_error="RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture",
                 torch_eager_ms={"1": 2.5, "16": 3.0})
        self.assertIsNone(ic.kiln_lead(g))
        self.assertTrue(ic.needs_compile(g))
        cells = ic.gpu_cells(row)
        self.assertIn("eager 2.500 / 3.000 (no CUDA graph)", cells)
        self.assertEqual(cells[-1], "pass")

    def test_argmax_agreement_of_images_and_of_a_segmentation_models_pixels(self):
        want = {"logits": np.array([[0.0, 1.0], [1.0, 0.0]]), "mask": np.zeros((1, 3, 2, 2)), "feat": np.zeros((1, 8, 2, 2))}
        want["mask"][0, 1] = 1.0
        got = {"logits": np.array([[0.0, 1.0], [0.0, 1.0]]), "mask": want["mask"].copy(), "feat": np.ones((1, 8, 2, 2))}
        got["mask"][0, 2, 0, 0] = 5.0
        seg = lambda d: {k: v for k, v in d.items() if k != "feat"}  # noqa: E731
        self.assertAlmostEqual(ic.argmax_agreement(seg(got), seg(want), "smp"), (1 + 3) / (2 + 4))
        self.assertAlmostEqual(ic.argmax_agreement(got, want, "timm"), 1 / 2)
        self.assertIsNone(ic.argmax_agreement({"feat": got["feat"]}, {"feat": want["feat"]}, "torchvision.detection"))

    def test_results_are_replaced_whole(self):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "results.json"
            ic.save_rows(path, [cpu_row("timm/a")], True, stopped=["timm/b"])
            data = json.loads(path.read_text())
            self.assertEqual((data["not_run"], len(data["models"])), (["timm/b"], 1))
            self.assertEqual(os.listdir(d), ["results.json"])

    def test_a_device_row_with_torch_compile_adds_both(self):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            (d / "cpu.json").write_text(json.dumps({"gpu": False, "models": [cpu_row("timm/a")]}))
            row = dict(gpu_row("timm/a", transformer=True), compile={"status": "pass", "compile_ms": {"1": 0.7, "16": 2.0}})
            (d / "dev.json").write_text(json.dumps({"gpu": True, "models": [row]}))
            doc = d / "IMPORT.md"
            doc.write_text(f"{ic.SUMMARY_BEGIN}\n{ic.SUMMARY_END}\n")
            old = ic.write_summary.__defaults__
            ic.write_summary.__defaults__ = (doc,)
            try:
                ic.merge([d / "cpu.json", d / "dev.json"], [ic.Entry("timm/a", "timm", 64)], d / "out.json", d / "out.md")
            finally:
                ic.write_summary.__defaults__ = old
            merged = json.loads((d / "out.json").read_text())["models"][0]
            self.assertEqual(merged["gpu"]["status"], "pass")
            self.assertEqual(merged["compile"]["compile_ms"]["16"], 2.0)
            self.assertEqual(merged["cpu_b2"], [1e-7, 1e-8])

    def test_each_model_is_claimed_by_one_worker(self):
        with tempfile.TemporaryDirectory() as d:
            claims = Path(d) / "claims"
            self.assertTrue(ic.claim(claims, "timm/vit_tiny"))
            self.assertFalse(ic.claim(claims, "timm/vit_tiny"))
            self.assertTrue(ic.claim(claims, "resnet18"))
            self.assertTrue(ic.claim(None, "resnet18"))  # no folder: one worker runs everything

    def test_a_timing_waits_for_the_checks_and_blocks_new_ones(self):
        import multiprocessing as mp

        with tempfile.TemporaryDirectory() as d:
            events = mp.Queue()
            # A check holds the GPU for 1.2 s; a timing asks for it at 0.3 s, a second check at
            # 0.6 s: the timing runs once the first check ends, and the second check after it.
            procs = [mp.Process(target=_turn, args=(d, kind, delay, hold, events))
                     for kind, delay, hold in (("check1", 0.0, 1.2), ("timing", 0.3, 0.4), ("check2", 0.6, 0.1))]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(10)
            log = []
            while not events.empty():
                log.append(events.get())
            log.sort(key=lambda e: e[2])
            order = [f"{what} {kind}" for kind, what, _ in log]
            self.assertEqual(order, ["start check1", "end check1", "start timing", "end timing", "start check2", "end check2"])

    def test_checks_share_the_gpu(self):
        import multiprocessing as mp

        with tempfile.TemporaryDirectory() as d:
            events = mp.Queue()
            procs = [mp.Process(target=_turn, args=(d, f"check{i}", 0.0, 0.3, events)) for i in range(2)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(10)
            log = sorted((events.get() for _ in range(4)), key=lambda e: e[2])
            self.assertEqual([what for _, what, _ in log], ["start", "start", "end", "end"])

    def test_only_a_compile_that_ran_out_of_time_runs_again(self):
        at = "abc1234"
        self.assertFalse(ic.settled(None, at))
        self.assertFalse(ic.settled({"status": "timeout", "commit": at, "reason": "torch.compile ran past the model's time"}, at))
        self.assertTrue(ic.settled({"status": "error", "commit": at, "reason": "BackendCompilerFailed: ..."}, at))
        self.assertTrue(ic.settled({"status": "pass", "commit": at}, at))
        self.assertTrue(ic.settled({"status": "fail", "commit": at, "reason": "FP16 engine: ..."}, at))

    def test_a_row_from_another_commit_runs_again(self):
        self.assertFalse(ic.settled({"status": "pass", "commit": "0ld0ld0"}, "abc1234"))
        self.assertFalse(ic.settled({"status": "pass"}, "abc1234"))

def _turn(folder, kind, delay, hold, events):
    """A worker of the turns tests: waits `delay`, takes a turn (a timing alone, a check shared),
    holds it for `hold` seconds and reports when it started and ended."""
    import time

    time.sleep(delay)
    turns = ic.GpuTurns(folder)
    with (turns.alone() if kind == "timing" else turns.shared()):
        events.put((kind, "start", time.time()))
        time.sleep(hold)
        events.put((kind, "end", time.time()))
    turns.close()


if __name__ == "__main__":
    unittest.main()
