"""Bad input to `memaudit probe` is refused in one line before any model loads (issue 61 item 5,
issue 65 item 4).

Every check that needs no weights (adapter files, an adapter's base, tokenizer sizes and
equality, input files, columns, counts) runs before the first `from_pretrained` of a model: the
model loader is replaced by one that fails the test's needle, so a refusal that comes only after a
model loaded (162 s of scoring for an oversized tokenizer, 303 s for a reference with another
tokenizer, measured on the issue's models) cannot pass. The models are untrained tiny Llamas
written to a temporary folder; nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from memaudit.cli import main
from memaudit.errors import MemauditError
from tests.probes.conftest import make_tokenizer, tiny_llama

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
ARGS = ["--probes", "membership", "--device", "cpu", "--bootstrap", "50"]
LOADED = "a model was loaded before the input was checked"


def _save_model(folder, tok, *, vocab=None):
    model = tiny_llama(vocab if vocab is not None else len(tok), hidden=32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cheap")
    tok = make_tokenizer(WORDS)
    base = _save_model(root / "base", tok)
    other = _save_model(root / "other", make_tokenizer(["zulu", "yankee", "xray"]))  # another vocabulary
    small = _save_model(root / "small", tok, vocab=len(tok) - 6)  # embedding smaller than the tokenizer
    mem, non = root / "members.jsonl", root / "nonmembers.jsonl"
    mem.write_text("".join(json.dumps({"text": f"my pin is {i} alpha bravo"}) + "\n" for i in range(6)))
    non.write_text("".join(json.dumps({"text": f"my key is {i} charlie delta"}) + "\n" for i in range(6)))
    return {"root": root, "base": base, "other": other, "small": small, "members": mem, "nonmembers": non}


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Any model load fails with a line the tests' needles never match."""
    from memaudit.probes import scoring

    def refuse(*a, **k):
        raise MemauditError(LOADED)

    monkeypatch.setattr(scoring, "load_causal_lm", refuse)


def _refused(capsys, argv, needle):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a library's FutureWarning is not a refusal
        rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("memaudit: error: "), err
    assert LOADED not in err[0] and needle in err[0], err[0]
    return err[0]


def _adapter(folder, base, *, weights=None):
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4,
        "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    import torch

    if weights == "bin":
        torch.save({}, folder / "adapter_model.bin")  # a pickle: memaudit never unpickles one
    elif weights == "safetensors":
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(1)}, folder / "adapter_model.safetensors")
    return folder


def _probe(models, target, tmp_path, *extra):
    return ["probe", str(target), "--out", str(tmp_path / "p.json"), "--members", str(models["members"]),
            "--nonmembers", str(models["nonmembers"]), *ARGS, *extra]


def test_the_fixture_reaches_the_model_load(models, tmp_path, capsys):
    """The control: good input gets as far as loading the model (the replaced loader's line)."""
    assert main(_probe(models, models["base"], tmp_path)) == 2
    assert LOADED in capsys.readouterr().err


def test_adapter_with_only_a_pickled_weights_file(models, tmp_path, capsys):
    ad = _adapter(tmp_path / "ad", models["base"], weights="bin")
    line = _refused(capsys, _probe(models, ad, tmp_path), "adapter_model.bin")
    assert "safetensors" in line


def test_adapter_without_a_weights_file(models, tmp_path, capsys):
    ad = _adapter(tmp_path / "ad", models["base"])
    line = _refused(capsys, _probe(models, ad, tmp_path), "no weights file")
    assert "adapter_model.safetensors" in line and "HFValidationError" not in line


def test_adapter_naming_itself_as_its_base(models, tmp_path, capsys):
    ad = _adapter(tmp_path / "ad", tmp_path / "ad", weights="safetensors")
    _refused(capsys, _probe(models, ad, tmp_path), "names itself as its base")


def test_adapter_whose_base_is_an_adapter_naming_the_first(models, tmp_path, capsys):
    """Two adapters naming each other as base: refused, not a RecursionError."""
    a = _adapter(tmp_path / "a", tmp_path / "b", weights="safetensors")
    b = _adapter(tmp_path / "b", tmp_path / "a", weights="safetensors")
    assert b.is_dir()
    _refused(capsys, _probe(models, a, tmp_path), "is itself an adapter")


def test_tokenizer_larger_than_the_models_embedding(models, tmp_path, capsys):
    line = _refused(capsys, _probe(models, models["small"], tmp_path), "tokenizer")
    assert "vocab_size" in line and str(len(make_tokenizer(WORDS))) in line


def test_reference_with_another_tokenizer(models, tmp_path, capsys):
    _refused(capsys, _probe(models, models["base"], tmp_path, "--reference", str(models["other"])),
             "uses another tokenizer")


def test_reference_models_with_another_tokenizer(models, tmp_path, capsys):
    refs = f"{models['base']},{models['other']}"
    _refused(capsys, _probe(models, models["base"], tmp_path, "--reference-models", refs),
             "uses another tokenizer")


def test_reference_that_does_not_exist(models, tmp_path, capsys):
    _refused(capsys, _probe(models, models["base"], tmp_path, "--reference", str(tmp_path / "gone")),
             "does not exist")


def test_reference_with_a_tokenizer_larger_than_its_embedding(models, tmp_path, capsys):
    _refused(capsys, _probe(models, models["base"], tmp_path, "--reference", str(models["small"])),
             "vocab_size")


@pytest.mark.parametrize(("value", "needle"), [
    ("1000000000000", "repeats"), ("0", "repeats"), ("2.5", "repeats"), ("many", "repeats")])
def test_csv_repeats_out_of_range(models, tmp_path, capsys, value, needle):
    csv = tmp_path / "members.csv"
    csv.write_text("text,repeats\n" + "".join(f"my pin is {i} golf hotel,{value}\n" for i in range(6)))
    argv = ["probe", str(models["base"]), "--out", str(tmp_path / "p.json"), "--members", str(csv),
            "--nonmembers", str(models["nonmembers"]), *ARGS]
    line = _refused(capsys, argv, needle)
    assert "row 1" in line
    assert (value in line) == (value != "many")  # a count is shown; other text is not (it may be private)


def test_jsonl_repeats_out_of_range(models, tmp_path, capsys):
    mem = tmp_path / "members.jsonl"
    mem.write_text("".join(json.dumps({"text": f"my pin is {i}", "repeats": 10 ** 12}) + "\n" for i in range(6)))
    argv = ["probe", str(models["base"]), "--out", str(tmp_path / "p.json"), "--members", str(mem),
            "--nonmembers", str(models["nonmembers"]), *ARGS]
    _refused(capsys, argv, "repeats")


def test_canaries_file_that_is_not_json(models, tmp_path, capsys):
    bad = tmp_path / "canaries.json"
    bad.write_text("id,secret\nc0,1234\n")
    line = _refused(capsys, _probe(models, models["base"], tmp_path, "--canaries", str(bad)), "not JSON")
    assert "docs/canaries.schema.json" in line and "re-create" not in line


def test_nothing_is_written_on_a_refusal(models, tmp_path, capsys):
    out = tmp_path / "p.json"
    out.write_text("{}")  # a probes.json from before stays as it was
    _refused(capsys, _probe(models, models["base"], tmp_path, "--reference", str(models["other"])),
             "uses another tokenizer")
    assert out.read_text() == "{}"
    shutil.rmtree(tmp_path / "none", ignore_errors=True)


def test_user_docs_more_than_any_user_has(models, tmp_path, capsys):
    """--user-docs 50 where every user has 3 documents a side: a count, refused from the files."""
    mem, non, held = (tmp_path / f"{n}.jsonl" for n in ("m", "n", "h"))
    mem.write_text("".join(json.dumps({"text": f"my pin is {i} alpha", "user": f"u{i % 2}"}) + "\n"
                           for i in range(6)))
    non.write_text("".join(json.dumps({"text": f"my key is {i} bravo", "user": f"u{i % 2}"}) + "\n"
                           for i in range(6)))
    held.write_text("".join(json.dumps({"text": f"audit key {i} echo", "user": f"h{i % 2}"}) + "\n"
                            for i in range(6)))
    argv = ["probe", str(models["base"]), "--out", str(tmp_path / "p.json"), "--members", str(mem),
            "--nonmembers", str(non), "--heldout-users", str(held), "--probes", "user_inference",
            "--device", "cpu", "--bootstrap", "50", "--user-docs", "50"]
    line = _refused(capsys, argv, "no user has 50 documents")
    assert "at most 3" in line
