"""The run's tokenizer in an export: Hugging Face files that encode as megaloop's tokenizer does,
the end-of-document id as eos in config and generation config, and a refused mismatch."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from megaloop.data import load_tokenizer
from megaloop.data.tokenizer_training import train_sentencepiece
from megaloop.hf.common import ConversionError
from megaloop.hf.to_hf import export_checkpoint

LINES = [f"the {w} sat on {n} mats, said   {w.upper()}!\n" for w in ("cat", "dog", "emu", "yak")
         for n in range(40)]


def _with_tokenizer(exports, tmp_path, tokenizer: Path, **data) -> Path:
    checkpoint = Path(shutil.copytree(exports.get("dense").checkpoint, tmp_path / "checkpoint"))
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    config["data"].update(tokenizer_model=str(tokenizer), eod_id=None, **data)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    return checkpoint


def _sentencepiece(tmp_path, byte_fallback=False) -> Path:
    model = tmp_path / "tok.model"
    train_sentencepiece(LINES, model, vocab_size=400, byte_fallback=byte_fallback,
                        hard_vocab_limit=False)
    return model


def _json_tokenizer(tmp_path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>", "<|endoftext|>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


@pytest.mark.parametrize("make", [_sentencepiece, _json_tokenizer])
def test_export_writes_a_tokenizer_that_encodes_as_megaloop(exports, tmp_path, make):
    from transformers import AutoTokenizer

    source = make(tmp_path)
    report = export_checkpoint(_with_tokenizer(exports, tmp_path, source), tmp_path / "out")
    assert report["tokenizer"] == str(source)
    sentencepiece = source.suffix == ".model"
    megaloop = load_tokenizer("SentencePieceTokenizer" if sentencepiece
                              else "HuggingFaceTokenizer", source)
    hf = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the emu sat on 7 mats,  said CAT!\nnew line"
    assert hf(text)["input_ids"] == megaloop.encode_batch([text])[0]
    assert hf.eos_token_id == megaloop.eod
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text())["eos_token_id"] == megaloop.eod
    assert (tmp_path / "out" / "tokenizer.model").exists() == sentencepiece


def test_an_exported_tokenizer_json_does_not_truncate_where_training_did_not(exports, tmp_path):
    """A tokenizer.json carrying truncation (GPT-2's at 1024 tokens; here 8) is exported without
    it, as megaloop's tokenizer encodes: read by the tokenizers library (as servers read it) the
    export encodes a long text whole (before: cut to 8 tokens)."""
    from tokenizers import Tokenizer

    source = _json_tokenizer(tmp_path)
    truncating = Tokenizer.from_file(str(source))
    truncating.enable_truncation(8)
    truncating.save(str(source))
    export_checkpoint(_with_tokenizer(exports, tmp_path, source), tmp_path / "out")
    text = " ".join(LINES[:3])
    exported = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).encode(text).ids
    assert exported == load_tokenizer("HuggingFaceTokenizer", source).encode_batch([text])[0]
    assert len(exported) > 8


def test_generate_never_chooses_the_embedding_rows_past_the_tokenizer(exports, tmp_path):
    """The model has 128 embedding rows, the tokenizer fewer: generate() skips the rest, as
    megaloop's greedy decoding does (megaloop.generation's vocab_size): each token is the argmax
    of the tokenizer's rows. Before, it chose a padding row wherever one scored highest (here:
    at some step), which decodes to nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    source = _json_tokenizer(tmp_path)
    export_checkpoint(_with_tokenizer(exports, tmp_path, source), tmp_path / "out")
    tokens = load_tokenizer("HuggingFaceTokenizer", source).vocab_size
    assert tokens < 128
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(tokens, 128))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    out = model.generate(torch.tensor([[5, 17, 42, 8]]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None)
    with torch.no_grad():
        logits = model(out).logits[0, 3:-1]
    assert torch.equal(out[0, 4:], logits[:, :tokens].argmax(-1))
    assert int(logits.argmax(-1).max()) >= tokens


def test_an_export_without_tokenizer_files_keeps_the_eod_the_run_trained_with(exports, tmp_path):
    """--no-tokenizer writes no tokenizer files, but the run's tokenizer (still there) ended its
    documents with an id: config.json and generation_config.json keep it as eos, so generate()
    stops where the model learned to (before: none, generating to max_new_tokens)."""
    source = _sentencepiece(tmp_path)
    export_checkpoint(_with_tokenizer(exports, tmp_path, source), tmp_path / "out",
                      with_tokenizer=False)
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    eod = load_tokenizer("SentencePieceTokenizer", source).eod
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text())["eos_token_id"] == eod


def test_an_export_without_tokenizer_files_suppresses_the_rows_past_the_runs_tokenizer(
        exports, tmp_path, caplog):
    """--no-tokenizer: generation_config.json suppresses the embedding rows past the tokenizer
    the run trained with, whose size its file says, or once it is gone, the data's sidecar
    (before: nothing suppressed, generate() free to pick a padding row). Known nowhere: one
    warning line naming the consequence, nothing suppressed."""
    from megaloop.data.preprocess import write_sidecar

    source = _json_tokenizer(tmp_path)
    tokens = load_tokenizer("HuggingFaceTokenizer", source).vocab_size
    prefix = str(tmp_path / "data_text_document")
    checkpoint = _with_tokenizer(exports, tmp_path, source, path=[prefix],
                                 tokenizer_type="HuggingFaceTokenizer")

    def suppressed(out):
        export_checkpoint(checkpoint, tmp_path / out, with_tokenizer=False)
        return json.loads((tmp_path / out / "generation_config.json").read_text()).get(
            "suppress_tokens")

    assert suppressed("from_file") == list(range(tokens, 128))
    source.unlink()
    with caplog.at_level("WARNING", logger="megaloop.hf"):
        assert suppressed("nowhere") is None
    assert "suppresses none of its 128 embedding rows, so generate() may choose a padding " \
           "row past the tokenizer" in caplog.text
    write_sidecar(prefix, {"vocab_size": tokens})
    assert suppressed("from_sidecar") == list(range(tokens, 128))


def test_refuses_a_tokenizer_larger_than_the_model_vocabulary(exports, tmp_path):
    source = _sentencepiece(tmp_path, byte_fallback=True)  # 256 byte pieces; the model has 128 rows
    with pytest.raises(ConversionError, match=r"tok.model: \d+ tokens, more than the model's "
                                              r"vocab_size=128"):
        export_checkpoint(_with_tokenizer(exports, tmp_path, source), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_a_tokenizer_in_place_of_the_runs_that_encodes_otherwise(exports, tmp_path):
    """--tokenizer replaces a run's tokenizer that moved; where the run's is still there, another
    model's tokenizer (a BPE of 100 tokens fits the 128 rows just as well) is a mistake."""
    run_tokenizer = _sentencepiece(tmp_path)
    checkpoint = _with_tokenizer(exports, tmp_path, run_tokenizer)
    other = _json_tokenizer(tmp_path)
    with pytest.raises(ConversionError, match=rf"^--tokenizer {other}: (encodes 'The quick .* as "
                                              rf"|ends documents with id ).*the run's "
                                              rf"data.tokenizer_model {run_tokenizer}"):
        export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(other))
    assert not (tmp_path / "out").exists()
    copy = Path(shutil.copy(run_tokenizer, tmp_path / "copy.model"))
    assert export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(copy))["tokenizer"] == \
        str(copy)


def test_refuses_a_tokenizer_ending_documents_otherwise_than_the_runs_eod_id(exports, tmp_path):
    """A run on pre-tokenized data names only its end-of-document id (here 5); a tokenizer whose
    eos is another id would make config.json's eos_token_id one the model never learned."""
    checkpoint = Path(shutil.copytree(exports.get("dense").checkpoint, tmp_path / "checkpoint"))
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    config["data"].update(tokenizer_model=None, eod_id=5)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    source = _sentencepiece(tmp_path)
    eod = load_tokenizer("SentencePieceTokenizer", source).eod
    with pytest.raises(ConversionError, match=rf"^--tokenizer {source}: ends documents with id "
                                              rf"{eod}, the run's data.eod_id is 5"):
        export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(source))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "Llama2Tokenizer"])
def test_a_legacy_tokenizer_run_exports_the_encoding_and_eod_it_trained_with(exports, tmp_path,
                                                                           tokenizer_type):
    """data.legacy_tokenizer: SentencePieceTokenizer's special strings (<EOD> among them) are ids
    past the model's pieces, <EOD> the trained EOD; Llama2Tokenizer starts texts with bos. The
    export's tokenizer encodes so, and generate() stops at the trained EOD."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    source = _sentencepiece(tmp_path)
    export_checkpoint(_with_tokenizer(exports, tmp_path, source, legacy_tokenizer=True,
                                      tokenizer_type=tokenizer_type), tmp_path / "out")
    megaloop = load_tokenizer(tokenizer_type, source, legacy=True)
    hf = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the emu<EOD> sat <CLS>on 7 mats,<MASK>  said CAT!<EOD>"
    ids = megaloop.encode_batch([text])[0]
    assert hf(text)["input_ids"] == ids
    plain = "the emu sat on 7 mats,  said CAT!"
    assert hf.decode(megaloop.encode_batch([plain])[0], skip_special_tokens=True) == \
        megaloop.decode(megaloop.encode_batch([plain])[0][ids[0] == 1:])
    eod, eod_name = megaloop.eod, ("<EOD>" if tokenizer_type == "SentencePieceTokenizer"
                                   else "</s>")
    assert hf.eos_token_id == eod and hf.convert_ids_to_tokens(eod) == eod_name
    assert hf.decode(hf(plain)["input_ids"] + [eod]).endswith(f"CAT!{eod_name}")
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "out" / name).read_text())["eos_token_id"] == eod

    planned = [5, eod, 7, 7]  # generation must stop at eod, the second token

    def force_plan(input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, planned[input_ids.shape[1] - prompt.shape[1]]] = 0
        return forced

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    prompt = torch.tensor([hf("the cat")["input_ids"]])
    out = model.generate(prompt, max_new_tokens=4,
                         logits_processor=LogitsProcessorList([force_plan]))
    assert out[0, prompt.shape[1]:].tolist() == [5, eod]


def test_a_conversion_that_encodes_otherwise_is_refused_naming_the_text(tmp_path, monkeypatch):
    """Literal <unk> is one added token to the Hugging Face tokenizer but pieces to megaloop's
    legacy one (it is none of Megatron-LM's special strings): a probe holding it fails."""
    from megaloop.hf import tokenizer as hf_tokenizer
    from megaloop.hf.common import ProbeMismatch

    monkeypatch.setattr(hf_tokenizer, "PROBE_TEXTS", ("x <unk>",))
    (tmp_path / "out").mkdir()
    with pytest.raises(ProbeMismatch, match=r"encodes 'x <unk>' as \[[\d, ]+\]\.\.\. "
                                            r"\(add_special_tokens=True\), megaloop as \[[\d, ]+"
                                            r"\]\.\.\. \(data.legacy_tokenizer=true\)$"):
        hf_tokenizer.write_tokenizer(_sentencepiece(tmp_path), tmp_path / "out", 128,
                                     "SentencePieceTokenizer", legacy=True)


def test_a_tokenizer_in_place_of_a_moved_one_is_checked_against_the_datas_sidecar(
        exports, tmp_path, caplog):
    """The run's tokenizer file is gone, so nothing could compare --tokenizer with it: another
    model's tokenizer (about 100 tokens, fitting the 128 rows) was exported for it without a word. The
    data's sidecar still says what the ids were made with."""
    from megaloop.data.preprocess import file_sha256, write_sidecar

    run_tokenizer = _sentencepiece(tmp_path)
    trained = load_tokenizer("SentencePieceTokenizer", run_tokenizer)
    prefix = str(tmp_path / "data_text_document")
    checkpoint = _with_tokenizer(exports, tmp_path, tmp_path / "moved.model", path=[prefix])
    other = _json_tokenizer(tmp_path)
    without_sidecar = export_checkpoint(checkpoint, tmp_path / "unchecked", tokenizer=str(other))
    assert without_sidecar["tokenizer"] == str(other)  # nothing to check it with: said, not refused
    assert "not checked against the run's" in caplog.text
    write_sidecar(prefix, {"tokenizer_type": "SentencePieceTokenizer",
                           "tokenizer_model": "tok.model",
                           "tokenizer_sha256": file_sha256(run_tokenizer),
                           "eod_id": trained.eod, "vocab_size": trained.vocab_size})
    with pytest.raises(ConversionError, match=rf"^--tokenizer {other}: vocab_size=\d+, but "
                                              rf"{prefix}.tokenizer.json says the run's data was "
                                              rf"tokenized with vocab_size={trained.vocab_size}"):
        export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(other))
    assert not (tmp_path / "out").exists()
    copy = Path(shutil.copy(run_tokenizer, tmp_path / "copy.model"))
    assert export_checkpoint(checkpoint, tmp_path / "out", tokenizer=str(copy))["tokenizer"] == \
        str(copy)


def test_the_runs_tokenizer_trained_anew_under_its_name_is_one_warning(exports, tmp_path,
                                                                       caplog):
    """Training refuses data whose sidecar names another tokenizer than the run's file, so a
    sidecar that does at export time means the file (or the data) was rewritten since. Before: the
    new tokenizer was exported for the model without a word."""
    from megaloop.data.preprocess import file_sha256, write_sidecar

    run_tokenizer = _sentencepiece(tmp_path)
    prefix = str(tmp_path / "data_text_document")
    write_sidecar(prefix, {"tokenizer_type": "SentencePieceTokenizer",
                           "tokenizer_model": "tok.model",
                           "tokenizer_sha256": file_sha256(run_tokenizer)})
    checkpoint = _with_tokenizer(exports, tmp_path, run_tokenizer, path=[prefix])
    export_checkpoint(checkpoint, tmp_path / "before")
    assert "rewritten" not in caplog.text  # the file the data was tokenized with
    train_sentencepiece(LINES[::2], run_tokenizer, vocab_size=60, byte_fallback=False,
                        hard_vocab_limit=False)
    export_checkpoint(checkpoint, tmp_path / "after")
    lines = [r.getMessage() for r in caplog.records if "rewritten" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"tokenizer {run_tokenizer}: sha256 {file_sha256(run_tokenizer)[:12]}, but "
        f"{prefix}.tokenizer.json says the run's data was tokenized with sha256 "), lines


def test_a_run_whose_tokenizer_is_a_directory_exports_and_is_compared(exports, tmp_path,
                                                                       caplog):
    """data.tokenizer_model may name a directory holding tokenizer.json (HuggingFaceTokenizer
    reads that file, and the data's sidecar records its sha256). Before: the export failed with
    IsADirectoryError while comparing the directory's sha256 with the sidecars'."""
    from megaloop.data.preprocess import file_sha256, write_sidecar

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    tokenizer = _json_tokenizer(directory)
    prefix = str(tmp_path / "data_text_document")
    write_sidecar(prefix, {"tokenizer_type": "HuggingFaceTokenizer",
                           "tokenizer_model": "tokenizer.json",
                           "tokenizer_sha256": file_sha256(tokenizer)})
    checkpoint = _with_tokenizer(exports, tmp_path, directory, path=[prefix],
                                 tokenizer_type="HuggingFaceTokenizer")
    assert export_checkpoint(checkpoint, tmp_path / "out")["tokenizer"] == str(directory)
    assert "rewritten" not in caplog.text
    tokenizer.write_text(tokenizer.read_text().replace('"mats"', '"mats" '))  # other bytes
    export_checkpoint(checkpoint, tmp_path / "again")
    assert len([r for r in caplog.records if "rewritten since the run" in r.getMessage()]) == 1


def test_an_unreadable_sidecar_of_the_runs_data_does_not_stop_the_export(exports, tmp_path,
                                                                         caplog):
    """The comparison of the run's tokenizer with its data's sidecars only warns. Before: a
    sidecar it could not read (corrupt, or on a mount the exporting user cannot read) was a
    DataError traceback, where the export had gone on before the comparison was added."""
    run_tokenizer = _sentencepiece(tmp_path)
    prefix = str(tmp_path / "data_text_document")
    Path(prefix + ".tokenizer.json").write_text("{cut short")
    checkpoint = _with_tokenizer(exports, tmp_path, run_tokenizer, path=[prefix])
    assert export_checkpoint(checkpoint, tmp_path / "out")["tokenizer"] == str(run_tokenizer)
    assert [r.getMessage().split(": ")[:2] for r in caplog.records if "not compared" in
            r.getMessage()] == [[f"tokenizer {run_tokenizer}", "not compared with the run's data"]]
