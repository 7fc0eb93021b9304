"""models/optimum.seq2seq_greedy, the reference the encoder-decoder tests hold the server
to: one Optimum process per test process answers every call (models/_optimum_generate.py
--serve), so a job that fails must not take it down or pass for an answer, and a process
that died is started again."""

from __future__ import annotations

import numpy as np
import pytest

from models import optimum

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

T5 = ("t5", "text2text-generation-with-past")


def test_a_failed_job_is_an_error_and_the_process_answers_the_next(tmp_path):
    folder = optimum.export_all([T5])[0].parent
    first = optimum.seq2seq_greedy([folder], new_tokens=4)[0]
    assert first["tokens"].shape == (2, 5) and first["scores"].shape[0] == 4
    pid = optimum._GENERATOR._proc.pid

    (tmp_path / "config.json").write_text('{"model_type": "t5", "vocab_size": 10}')
    with pytest.raises(RuntimeError, match="optimum could not generate from") as failed:
        optimum.seq2seq_greedy([tmp_path], new_tokens=4)
    assert "Traceback" in str(failed.value) and str(tmp_path) in str(failed.value)

    again = optimum.seq2seq_greedy([folder], new_tokens=4)[0]
    assert optimum._GENERATOR._proc.pid == pid  # the same process
    np.testing.assert_array_equal(again["tokens"], first["tokens"])
    np.testing.assert_array_equal(again["scores"], first["scores"])


def test_a_process_that_died_is_started_again(monkeypatch):
    folder = optimum.export_all([T5])[0].parent
    first = optimum.seq2seq_greedy([folder], new_tokens=3)[0]
    optimum._GENERATOR._proc.kill()  # between two jobs
    optimum._GENERATOR._proc.wait()
    again = optimum.seq2seq_greedy([folder], new_tokens=3)[0]
    np.testing.assert_array_equal(again["tokens"], first["tokens"])

    started = optimum._GENERATOR._started

    def dies_on_the_job():  # the process as it is handed a job, killed
        proc = started()
        proc.kill()
        proc.wait()
        return proc

    monkeypatch.setattr(optimum._GENERATOR, "_started", dies_on_the_job)
    with pytest.raises(RuntimeError, match=r"\(exit -9\)"):  # that job fails, saying how
        optimum.seq2seq_greedy([folder], new_tokens=3)
    monkeypatch.undo()
    third = optimum.seq2seq_greedy([folder], new_tokens=3)[0]
    np.testing.assert_array_equal(third["tokens"], first["tokens"])
