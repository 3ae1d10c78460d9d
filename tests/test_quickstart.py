"""The README's main job, shrunk: corpus, tokenizer, indexed data, three models, table, curves."""

import json

from megaloop.quickstart import main, multi_hop_program


def test_generated_programs_answer_their_query():
    import random

    rng = random.Random(3)
    for _ in range(50):
        program = multi_hop_program(rng)
        statements, query = program.rsplit(" ; ? ", 1)
        name, value = query.split(" = ")
        bindings = dict(s.split(" = ") for s in statements.split(" ; "))
        while not bindings[name].isdigit():  # follow the chain of references
            name = bindings[name]
        assert bindings[name] == value


def test_quickstart_runs_end_to_end(mcore, tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "3", "--documents", "200"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"dense", "fullloop", "asymloop"}
    assert {r["depth"] for r in results.values()} == {8}
    assert "val_loss_k6" in results["asymloop"] and results["dense"]["val_ppl"] > 1
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "asymloop" in table and "val CE" in table
