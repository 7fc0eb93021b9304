"""`tuner verify` as a user meets it: inputs the original cannot run are bad input (exit 2), and
an output that was never compared does not print the numbers of a perfect match."""

from __future__ import annotations

import numpy as np

from tuner.cli import main


def test_inputs_the_original_cannot_run_exit_2(reference_model, tmp_path, capsys):
    src = reference_model("bert", "small", "torchscript")
    npz = tmp_path / "oov.npz"  # token id far past the vocabulary: ORT's Gather refuses it
    np.savez(npz, input_ids=np.array([[1, 2, 999_999]], np.int64),
             attention_mask=np.ones((1, 3), np.int64))
    assert main(["verify", str(src), str(src), "--inputs", str(npz)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("tuner:")]
    assert len(lines) == 1 and "cannot run these inputs" in lines[0] and "oov.npz" in lines[0]


def test_uncompared_output_prints_dashes_not_a_perfect_match(reference_model, capsys):
    bert = reference_model("bert", "small", "torchscript")
    gpt2 = reference_model("gpt2", "small", "torchscript")  # same inputs, other output name
    assert main(["verify", str(bert), str(gpt2)]) == 1
    row = next(ln for ln in capsys.readouterr().out.splitlines()
               if ln.startswith("last_hidden_state"))
    assert "missing in the candidate" in row
    assert "1.000000" not in row and row.split()[1:4] == ["-", "-", "-"]


def test_bad_vocab_and_seed_flags_exit_2(reference_model, capsys):
    src = str(reference_model("bert", "small", "torchscript"))
    # 0 used to fall back to the model's vocabulary silently; -1 seed was a traceback (exit 1);
    # a --vocab past the embedding made the *original* fail, reported as the variant's FAIL
    for args, message in [(["--vocab", "0"], "--vocab must be >= 1"),
                          (["--seed", "-1"], "--seed must be >= 0"),
                          (["--vocab", "100000"], "token ids below --vocab 100000: the original")]:
        assert main(["verify", src, src, *args]) == 2, args
        err = capsys.readouterr().err
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("tuner:")]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
