"""Bad input across every command: exit 2, exactly one line on stderr naming the file or key,
no traceback, and nothing that was on disk before changed (sha256 of every file).

Each case builds what it needs under a fresh folder (a copy of the session's trained tiny run
where a run is needed), runs the CLI in-process, and compares hashes before and after.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memaudit.cli import main
from tests.conftest import REPO_ROOT, tiny_train_args

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@dataclass
class Case:
    id: str
    argv: Callable[[Path, dict], list[str]]  # (case folder, context) -> argv
    needle: str | Callable[[Path], str]  # text that names the file or key
    setup: Callable[[Path, dict], None] = lambda d, ctx: None
    needs_run: bool = False
    may_create: tuple[str, ...] = field(default_factory=tuple)  # new paths allowed (relative)


def _run(ctx: dict) -> str:
    return str(ctx["run"])


def _remote_code_model(d: Path) -> None:
    """A model folder whose architecture exists only in its own Python file."""
    m = d / "remote"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"model_type": "acme_lm", "auto_map": {
        "AutoModelForCausalLM": "modeling_acme.AcmeLM"}}))
    (m / "modeling_acme.py").write_text("raise SystemExit('remote code ran')\n")


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def _train(d: Path, *sets: str) -> list[str]:
    return ["train", TINY, "--out", str(d / "out"), *tiny_train_args(*sets)]


def _cfg(d: Path, text: str) -> str:
    _write(d / "c.yaml", text)
    return str(d / "c.yaml")


def _corrupt(rel: str, data: bytes) -> Callable[[Path, dict], None]:
    def setup(d: Path, ctx: dict) -> None:
        _write(ctx["run"] / rel, data)
    return setup


def _interrupted(ctx: dict) -> None:
    """Make the copied run resumable: status interrupted with its checkpoint in place."""
    m = json.loads((ctx["run"] / "run.json").read_text())
    m["status"] = "interrupted"
    (ctx["run"] / "run.json").write_text(json.dumps(m))


def _resume_with(rel: str, data: bytes | None) -> Callable[[Path, dict], None]:
    def setup(d: Path, ctx: dict) -> None:
        _interrupted(ctx)
        if data is None:
            shutil.rmtree(ctx["run"] / "state")
            _write(ctx["run"] / "state", b"not a directory")
        else:
            _write(ctx["run"] / rel, data)
    return setup


PICKLE = (b"\x80\x04\x95\x1e\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94"
          b"\x8c\x04true\x94\x85\x94R\x94.")


def _foreign_run(out: Path) -> None:
    """Another tool's output folder whose run.json happens to hold a `status` field."""
    _write(out / "run.json", json.dumps({"status": "complete", "job": "nightly-etl"}))
    _write(out / "data" / "users.csv", "id,name\n1,ada\n")
    _write(out / "model" / "weights.bin", b"\x00" * 64)


CASES = [
    # ---- train: the config
    Case("config-missing", lambda d, c: ["train", str(d / "nope.yaml")], "nope.yaml"),
    Case("config-yaml", lambda d, c: ["train", _cfg(d, "train: {steps: 3\n")], "YAML"),
    Case("config-list", lambda d, c: ["train", _cfg(d, "- 1\n- 2\n")], "c.yaml"),
    Case("config-dir", lambda d, c: ["train", str(d)], ""),
    Case("unknown-key", lambda d, c: _train(d, "train.nope=1"), "train.nope"),
    Case("override-no-equals", lambda d, c: ["train", TINY, "--set", "train.lr"], "train.lr"),
    Case("lr-negative", lambda d, c: _train(d, "train.lr=-1"), "train.lr"),
    Case("lr-inf", lambda d, c: _train(d, "train.lr=inf"), "train.lr"),
    Case("lr-nan", lambda d, c: _train(d, "train.lr=nan"), "train.lr"),
    Case("batch-huge", lambda d, c: _train(d, "train.batch_size=1e12"), "train.batch_size"),
    Case("steps-zero", lambda d, c: _train(d, "train.steps=0"), "train.steps"),
    Case("grad-clip-inf", lambda d, c: _train(d, "train.grad_clip=nan"), "train.grad_clip"),
    Case("clip-negative", lambda d, c: _train(d, "privacy.clip=-1"), "privacy.clip"),
    Case("sigma-nan", lambda d, c: _train(d, "privacy.noise_multiplier=nan"), "privacy.noise_multiplier"),
    Case("sigma-negative", lambda d, c: _train(d, "privacy.noise_multiplier=-1"), "privacy.noise_multiplier"),
    Case("target-eps-inf", lambda d, c: _train(d, "privacy.target_epsilon=inf"), "privacy.target_epsilon"),
    Case("delta-one", lambda d, c: _train(d, "privacy.delta=1"), "privacy.delta"),
    Case("template-other-placeholder", lambda d, c: _train(d, "data.canaries.template=my {pin} is {secret}"),
         "data.canaries.template"),
    Case("template-no-secret", lambda d, c: _train(d, "data.canaries.template=no secret here"),
         "data.canaries.template"),
    Case("seq-len-small", lambda d, c: _train(d, "data.seq_len=4"), "data.seq_len"),
    Case("audit-document-spans-two-sequences",
         lambda d, c: _train(d, "data.audit_canaries=8", "data.canaries.audit_kind=document", "data.seq_len=64"),
         "data.seq_len"),
    Case("audit-kind-unknown", lambda d, c: _train(d, "data.canaries.audit_kind=image"),
         "data.canaries.audit_kind"),
    Case("heldout-one", lambda d, c: _train(d, "data.heldout_users=1"), "data.heldout_users"),
    Case("lora-rank-zero", lambda d, c: _train(d, "model.lora.rank=0"), "model.lora.rank"),
    Case("lora-rank-above-dim", lambda d, c: _train(d, "model.lora.rank=129"), "model.lora.rank"),
    Case("lora-unknown-module", lambda d, c: _train(d, "model.lora.target_modules=[qkv_proj]"), "qkv_proj"),
    Case("lora-init-from-adapter", lambda d, c: _train(d, f"model.init_from={d / 'ad'}", "model.lora.rank=4"),
         "PEFT adapter", setup=lambda d, c: _write(d / "ad" / "adapter_config.json", b"{}")),
    Case("backend-unknown", lambda d, c: _train(d, "backend=jax"), "backend"),
    Case("backend-flag", lambda d, c: ["train", TINY, "--backend", "mpi"], "mpi"),
    Case("data-path-missing", lambda d, c: _train(d, f"data.path={d / 'none.jsonl'}"), "none.jsonl"),
    Case("data-path-empty", lambda d, c: _train(d, f"data.path={d / 'e.jsonl'}"), "e.jsonl",
         setup=lambda d, c: _write(d / "e.jsonl", b"")),
    Case("dataset-unknown", lambda d, c: _train(d, "data.path=nosuchdataset"), "nosuchdataset"),
    Case("tokenizer-missing", lambda d, c: _train(d, f"data.tokenizer={d / 'tok'}"), "data.tokenizer"),
    Case("grid-does-not-divide", lambda d, c: _train(d, "parallel.x=3"), "parallel"),
    Case("lora-grid-does-not-divide", lambda d, c: _train(d, "model.lora.rank=4", "parallel.x=3"),
         "parallel.x=3 does not divide A's columns"),
    Case("mesh-too-large", lambda d, c: _train(d, "backend=federated", "federated.mesh_clients=64"),
         "federated.mesh_clients"),
    Case("fedsgd-with-dp", lambda d, c: _train(d, "backend=federated", "federated.algorithm=fedsgd",
                                               "privacy.noise_multiplier=1"), "fedsgd"),
    # ---- train: the output folder
    Case("out-is-file", lambda d, c: ["train", TINY, "--out", str(d / "f")], "f",
         setup=lambda d, c: _write(d / "f", "x")),
    Case("out-under-file", lambda d, c: ["train", TINY, "--out", str(d / "f" / "run")], "f",
         setup=lambda d, c: _write(d / "f", "x")),
    Case("out-foreign-dir", lambda d, c: ["train", TINY, "--out", str(d / "mine")], "not a memaudit run",
         setup=lambda d, c: (_write(d / "mine" / "data" / "thesis.tex", "keep"),
                             _write(d / "mine" / "metrics.jsonl", "{}\n"))),
    Case("overwrite-foreign-dir", lambda d, c: ["train", TINY, "--out", str(d / "mine"), "--overwrite"],
         "not a memaudit run",
         setup=lambda d, c: (_write(d / "mine" / "model" / "weights.bin", "keep"),
                             _write(d / "mine" / "state" / "notes", "keep"))),
    Case("overwrite-run-bad-config", lambda d, c: ["train", TINY, "--out", _run(c), "--overwrite",
                                                   "--set", "train.lr=-3"], "train.lr", needs_run=True),
    Case("overwrite-run-bad-data", lambda d, c: ["train", TINY, "--out", _run(c), "--overwrite",
                                                 "--set", f"data.path={d / 'gone.jsonl'}"], "gone.jsonl",
         needs_run=True),
    Case("overwrite-run-bad-grid", lambda d, c: ["train", TINY, "--out", _run(c), "--overwrite",
                                                 "--set", "parallel.y=3"], "parallel", needs_run=True),
    Case("complete-run-no-overwrite", lambda d, c: ["train", TINY, "--out", _run(c)], "--overwrite",
         needs_run=True),
    # ---- train --resume
    Case("resume-not-run", lambda d, c: ["train", "--resume", str(d)], "not a memaudit run"),
    Case("resume-with-out", lambda d, c: ["train", "--resume", str(d), "--out", str(d)], "--resume"),
    Case("resume-complete", lambda d, c: ["train", "--resume", _run(c)], "already complete", needs_run=True),
    Case("manifest-list", lambda d, c: ["train", "--resume", _run(c)], "run.json", needs_run=True,
         setup=_corrupt("run.json", b"[]")),
    Case("manifest-no-status", lambda d, c: ["train", "--resume", _run(c)], "run.json", needs_run=True,
         setup=_corrupt("run.json", b'{"config": {}}')),
    Case("manifest-garbage", lambda d, c: ["train", "--resume", _run(c)], "run.json", needs_run=True,
         setup=_corrupt("run.json", b"\xff\xfe{")),
    Case("manifest-config-int", lambda d, c: ["train", "--resume", _run(c)], "run.json", needs_run=True,
         setup=_corrupt("run.json", b'{"status": "interrupted", "config": 3, "backend": "parallel"}')),
    Case("lock-list", lambda d, c: ["train", "--resume", _run(c)], "run.lock", needs_run=True,
         setup=lambda d, c: (_interrupted(c), _write(c["run"] / "run.lock", b"[]"))),
    Case("lock-no-fields", lambda d, c: ["train", "--resume", _run(c)], "run.lock", needs_run=True,
         setup=lambda d, c: (_interrupted(c), _write(c["run"] / "run.lock", b'{"pid": "x"}'))),
    Case("resume-state-garbage", lambda d, c: ["train", "--resume", _run(c)], "state", needs_run=True,
         setup=_resume_with("state/model.safetensors", b"garbage" * 10)),
    Case("resume-state-truncated", lambda d, c: ["train", "--resume", _run(c)], "state", needs_run=True,
         setup=lambda d, c: (_interrupted(c), (c["run"] / "state" / "model.safetensors").write_bytes(
             (c["run"] / "state" / "model.safetensors").read_bytes()[:100]))),
    Case("resume-state-pickle", lambda d, c: ["train", "--resume", _run(c)], "state", needs_run=True,
         setup=_resume_with("state/optimizer.pt", PICKLE)),
    Case("resume-state-is-file", lambda d, c: ["train", "--resume", _run(c)], "state", needs_run=True,
         setup=_resume_with("state", None)),
    Case("resume-changed-key", lambda d, c: ["train", "--resume", _run(c), "--set", "train.lr=0.5"],
         "train.lr", needs_run=True, setup=lambda d, c: _interrupted(c)),
    Case("resume-changed-corpus", lambda d, c: ["train", "--resume", _run(c)], "changed", needs_run=True,
         setup=lambda d, c: (_interrupted(c), _edit_corpus(c))),
    # ---- probe
    Case("probe-missing", lambda d, c: ["probe", str(d / "none")], "none"),
    Case("probe-not-a-model", lambda d, c: ["probe", str(d)], ""),
    Case("probe-model-garbage", lambda d, c: ["probe", _run(c), "--probes", "exposure"], "model",
         needs_run=True, setup=_corrupt("model/model.safetensors", b"\x00" * 64)),
    Case("probe-out-dir", lambda d, c: ["probe", _run(c), "--probes", "exposure", "--out", str(d)],
         "--out", needs_run=True),
    Case("probe-unknown", lambda d, c: ["probe", _run(c), "--probes", "bogus"], "bogus", needs_run=True),
    Case("probe-batch-zero", lambda d, c: ["probe", _run(c), "--batch-size", "0"], "batch", needs_run=True),
    Case("probe-format", lambda d, c: ["probe", _run(c), "--format", "xml"], "xml", needs_run=True),
    Case("probe-data-replaced", lambda d, c: ["probe", _run(c), "--probes", "exposure"], "fingerprint",
         needs_run=True, setup=lambda d, c: _replace_fingerprint(c)),
    Case("probe-canaries-garbage", lambda d, c: ["probe", _run(c), "--probes", "exposure"], "data",
         needs_run=True, setup=_corrupt("canaries.json", b"{not json")),
    Case("probe-hub-not-cached", lambda d, c: ["probe", "acme/not-cached-model", "--out",
                                                str(d / "p.json")], "hf download acme/not-cached-model"),
    Case("probe-remote-code", lambda d, c: ["probe", str(d / "remote"), "--out", str(d / "p.json")],
         "trust_remote_code", setup=lambda d, c: _remote_code_model(d)),
    Case("probe-missing-column", lambda d, c: ["probe", _run(c), "--probes", "membership", "--members",
                                               str(d / "m.csv"), "--out", str(d / "p.json")],
         "no column 'text'", needs_run=True,
         setup=lambda d, c: (d / "m.csv").write_text("body\nsome text\n")),
    Case("probe-fpr-negatives", lambda d, c: ["probe", _run(c), "--probes", "membership", "--nonmembers",
                                              str(d / "n.txt"), "--fpr", "0.01", "--out", str(d / "p.json")],
         "needs at least 1000 non-member documents", needs_run=True,
         setup=lambda d, c: (d / "n.txt").write_text("zq one\nzq two\nzq three\n")),
    Case("probe-canaries-empty", lambda d, c: ["probe", _run(c), "--probes", "exposure", "--canaries",
                                               str(d / "c.json"), "--out", str(d / "p.json")],
         "lists no canaries", needs_run=True,
         setup=lambda d, c: (d / "c.json").write_text('{"template": "my pin is {secret}", "secret_length": 4}')),
    # ---- report
    Case("report-missing", lambda d, c: ["report", str(d / "none"), "--out", str(d / "rep")], "none"),
    Case("report-probes-list", lambda d, c: ["report", _run(c), "--out", str(d / "rep")], "probes.json",
         needs_run=True, setup=_corrupt("probes.json", b"[]")),
    Case("report-out-file", lambda d, c: ["report", _run(c), "--out", str(d / "f")], "f", needs_run=True,
         setup=lambda d, c: _write(d / "f", "x")),
    Case("report-data-replaced", lambda d, c: ["report", _run(c), "--out", str(d / "rep")], "fingerprint",
         needs_run=True, setup=lambda d, c: _replace_fingerprint(c)),
    # ---- sweep
    Case("sweep-missing", lambda d, c: ["sweep", str(d / "s.yaml"), "--out", str(d / "sw")], "s.yaml"),
    Case("sweep-out-file", lambda d, c: ["sweep", _sweep(d), "--out", str(d / "f")], "f",
         setup=lambda d, c: _write(d / "f", "x")),
    Case("sweep-base-list", lambda d, c: ["sweep", _sweep(d, "base_config: [a, b]\n"), "--out", str(d / "sw")],
         "base_config"),
    Case("sweep-empty-grid", lambda d, c: ["sweep", _sweep(d), "--out", str(d / "sw"), "--epsilons", ""],
         "epsilon"),
    Case("sweep-bad-probe", lambda d, c: ["sweep", _sweep(d, "probe: {batch_size: 0}\n"), "--out",
                                          str(d / "sw")], "batch_size"),
    Case("sweep-jobs-zero", lambda d, c: ["sweep", _sweep(d), "--out", str(d / "sw"), "--jobs", "0"], "jobs"),
    # a newline in an executor string would become a line of the sbatch script
    Case("sweep-executor-newline", lambda d, c: ["sweep", _sweep(d, 'executor: {kind: slurm, partition: "gpu\\n'
                                                                  '#SBATCH --wrap=id"}\n'), "--out", str(d / "sw")],
         "executor.partition"),
    Case("sweep-executor-option-newline", lambda d, c: ["sweep", _sweep(d, 'executor: {kind: slurm, slurm_additional: '
                                                                         '{comment: "a\\rb"}}\n'), "--out", str(d / "sw")],
         "executor.slurm_additional"),
    # ---- epsilon
    Case("epsilon-huge-steps", lambda d, c: ["epsilon", "-q", "0.01", "-s", "1", "-T", "1e12", "--delta", "1e-5"], "-T"),
    Case("epsilon-sigma-inf", lambda d, c: ["epsilon", "-q", "0.01", "-s", "inf", "-T", "10", "--delta", "1e-5"], "noise"),
    Case("epsilon-q-two", lambda d, c: ["epsilon", "-q", "2", "-s", "1", "-T", "10", "--delta", "1e-5"], "sampling"),
    Case("epsilon-delta-zero", lambda d, c: ["epsilon", "-q", "0.1", "-s", "1", "-T", "10", "--delta", "0"],
         "delta"),
    # ---- data
    Case("synth-under-file", lambda d, c: ["data", "synth", "--out", str(d / "f" / "c.jsonl")], "f",
         setup=lambda d, c: _write(d / "f", "x")),
    Case("synth-users-one", lambda d, c: ["data", "synth", "--users", "1", "--out", str(d / "c.jsonl")],
         "--users"),
    Case("prepare-out-file", lambda d, c: ["data", "prepare", TINY, "--out", str(d / "f")], "f",
         setup=lambda d, c: _write(d / "f", "x")),
    # ---- train --overwrite: only a folder whose run.json memaudit wrote is replaced
    Case("overwrite-foreign-run-json", lambda d, c: [*_train(d), "--overwrite"], "run.json",
         setup=lambda d, c: _foreign_run(d / "out")),
    # ---- parallel plan
    Case("plan-mem-nan", lambda d, c: ["parallel", "plan", "--gpus", "8", "--mem-gib", "nan"], "mem"),
    Case("plan-mem-negative", lambda d, c: ["parallel", "plan", "--gpus", "8", "--mem-gib", "-5"], "mem"),
    Case("plan-gpus-zero", lambda d, c: ["parallel", "plan", "--gpus", "0"], "gpus"),
]


def _sweep(d: Path, extra: str = "") -> str:
    text = f"base_config: {TINY}\ngrid: {{backends: [centralized], epsilons: [inf]}}\n" + extra
    if extra.startswith("base_config"):
        text = extra + "grid: {backends: [centralized], epsilons: [inf]}\n"
    _write(d / "s.yaml", text)
    return str(d / "s.yaml")


def _edit_corpus(ctx: dict) -> None:
    """Train-time corpus = a copy in the case folder (run.json and data/meta.json say so), then
    that copy is edited: what a user who changed the corpus before --resume does."""
    from memaudit.config import config_from_dict
    from memaudit.data.prepare import config_hash

    run = ctx["run"]
    m = json.loads((run / "run.json").read_text())
    m["config"]["data"]["path"] = str(ctx["corpus"])
    (run / "run.json").write_text(json.dumps(m))
    meta = json.loads((run / "data" / "meta.json").read_text())
    meta["config_hash"] = config_hash(config_from_dict(m["config"]).data, meta["vocab_size"])
    (run / "data" / "meta.json").write_text(json.dumps(meta))
    corpus = Path(ctx["corpus"])
    corpus.write_text(corpus.read_text() + json.dumps({"text": "one more document", "user": "u999"}) + "\n")


def _replace_fingerprint(ctx: dict) -> None:
    m = json.loads((ctx["run"] / "run.json").read_text())
    m["data_fingerprint"] = "0" * 64
    (ctx["run"] / "run.json").write_text(json.dumps(m))


@pytest.fixture
def case_dir(tmp_path, tiny_run, request):
    """A folder for one case, holding a copy of the trained tiny run (and its corpus)."""
    case: Case = request.param
    ctx: dict = {}
    d = tmp_path / "case"
    d.mkdir()
    if case.needs_run:
        ctx["run"] = d / "run"
        shutil.copytree(tiny_run["path"], ctx["run"])
        m = json.loads((ctx["run"] / "run.json").read_text())
        corpus = d / "corpus.jsonl"
        shutil.copy(m["config"]["data"]["path"], corpus)
        ctx["corpus"] = corpus
        if not (ctx["run"] / "probes.json").exists():
            (ctx["run"] / "probes.json").write_text("{}")
    case.setup(d, ctx)
    return case, d, ctx


@pytest.mark.parametrize("case_dir", CASES, ids=[c.id for c in CASES], indirect=True)
def test_bad_input_is_one_line_and_changes_nothing(case_dir, capsys):
    case, d, ctx = case_dir
    argv = case.argv(d, ctx)
    before = snapshot(d)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)  # one line, no blank line after it
    assert err.startswith("memaudit: error: ") and "Traceback" not in err, err
    needle = case.needle(d) if callable(case.needle) else case.needle
    assert needle in err, err
    assert "Traceback" not in out
    after = snapshot(d)
    changed = sorted(k for k in before if after.get(k) != before[k])
    created = sorted(k for k in after if k not in before and not k.startswith(case.may_create))
    assert not changed, changed
    assert not created, created


def test_the_suite_covers_every_command(tmp_path):
    commands = {c.argv(tmp_path, {"run": tmp_path / "r"})[0] for c in CASES}
    assert commands >= {"train", "probe", "report", "sweep", "epsilon", "data", "parallel"}
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
