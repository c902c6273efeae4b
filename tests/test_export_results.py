"""What every export reports, written once (reshard.jobs.results.ExportResult), and each format's summary.

    python -m pytest -q tests/test_export_results.py      # fast tier: no process, no checkpoint

Each format's result adds only what it wrote; the summary's lines (first line, the run's figures, the
format's details, the notes) come from one `summary()`. The texts below are those each format printed
when it wrote its own summary (checked against the code before ExportResult, every layout and option).
"""
from reshard.export.dcp_job import DcpResult
from reshard.export.safetensors_job import SafetensorsResult
from reshard.export.universal import UniversalResult
from reshard.jobs.results import ExportResult

DONE = ExportResult("/src", "/out", "g3", 2, 3, 1.25, [10, 20], ["resumed"])


def test_each_format_keeps_what_every_export_reports():
    for result in (DcpResult.of(DONE, files=["__0_0.distcp"]), UniversalResult.of(DONE, params=7),
                   SafetensorsResult.of(DONE, files=["model.safetensors"], total_size=12345)):
        assert (result.source, result.destination, result.tag, result.workers, result.rounds, result.seconds,
                result.peak_rss_bytes, result.notes) == ("/src", "/out", "g3", 2, 3, 1.25, [10, 20], ["resumed"])


def test_summaries_read_as_each_format_wrote_them():
    assert DcpResult.of(DONE, files=["__0_0.distcp", "__1_0.distcp"]).summary() == (
        "export done: /src (tag g3) -> /out (PyTorch DCP)\n"
        "  2 .distcp files; 2 workers, 3 rounds, 1.2 s; load with dcp.load + set_state_dict "
        "(docs/moving-to-fsdp2.md); counters, LR scheduler and client_state (and an fp16 run's loss scaler) in "
        "reshard_run_state.pt\n"
        "  note: resumed")
    accelerate = DcpResult.of(DONE, files=["__0_0.distcp"], layout="accelerate", carried=["a", "b"]).summary()
    assert "; 2 files of the save directory carried (trainer_state.json, scheduler.pt...): resume with " \
           "trainer.train(resume_from_checkpoint=OUT) under FSDP2" in accelerate, accelerate
    assert UniversalResult.of(DONE, params=7).summary() == (
        "export done: /src (tag g3) -> /out (DeepSpeed universal)\n"
        '  7 parameters; 2 workers, 3 rounds, 1.2 s; load with "checkpoint": {"load_universal": true}\n'
        "  note: resumed")
    assert SafetensorsResult.of(DONE, files=["model.safetensors"], total_size=12345, kept_for_tied={"h.w": "e.w"},
                                tied_files={"layer_01": "embed"}, model_files=["config.json"]).summary() == (
        "export done: /src (tag g3) -> /out\n"
        "  1 safetensors file, 12,345 bytes of tensors; 2 workers, 3 rounds, 1.2 s\n"
        "  tied: h.w stored as e.w, layer_01 as tied_modules.embed\n"
        "  copied from the save directory: config.json\n"
        "  note: resumed\n"
        "  note: no tokenizer files in the save directory: AutoTokenizer.from_pretrained(OUT) needs them; write "
        "them with tokenizer.save_pretrained(OUT)")
