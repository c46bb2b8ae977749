"""The CLI in a shell's pipes, against the live server: '-' reads the prompt or the texts
from stdin, a reader that leaves stdout early ends the command quietly, and `list NAME`
of an unknown name fails in one line as the other commands do."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.live_server import ALICE, run_cli

PROMPT = "The lighthouse keeper"
TEXTS = ["what a wonderful, moving film", "a dull and boring mess"]


def _flags(server) -> list[str]:
    return ["--server", server.grpc, "--api-key", ALICE]


def test_generate_reads_the_prompt_from_stdin(server, uploaded, monkeypatch):
    argv = ["generate", "--json", "--temperature", "0", "--max-tokens", "8", "--adapter", "sql", *_flags(server)]
    status, given, err = run_cli(*argv, PROMPT)
    assert status == 0, err
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))  # as `echo PROMPT |` sends it
    status, piped, err = run_cli(*argv, "-")
    assert status == 0, err
    assert json.loads(piped) == json.loads(given)
    assert json.loads(piped)["prompt_tokens"] > 0


@pytest.mark.parametrize("command", [["classify", "--adapter", "sentiment"], ["embed"]])
def test_texts_come_one_per_line_from_stdin(server, command, monkeypatch):
    status, given, err = run_cli(*command, "--json", *_flags(server), *TEXTS)
    assert status == 0, err
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{TEXTS[1]}\n\n"))  # blank lines are no texts
    status, piped, err = run_cli(*command, "--json", *_flags(server), TEXTS[0], "-")
    assert status == 0, err
    assert piped == given and len(piped.splitlines()) == len(TEXTS)


def _with_stdout_closed(*argv: str) -> subprocess.CompletedProcess:
    """Run the CLI with stdout a pipe whose reader has already gone (`| head -0`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "adapterserve.clients.cli", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("argv", [
    ["generate", "--max-tokens", "32", "--ignore-eos", PROMPT],  # streamed: fails at the first token
    ["generate", "--json", "--max-tokens", "4", PROMPT],
    ["list"],
    ["info"],
])
def test_a_reader_that_leaves_ends_the_command_quietly(server, argv):
    done = _with_stdout_closed(*argv, *_flags(server))
    assert (done.returncode, done.stderr) == (141, "")


def test_version_into_a_closed_pipe_ends_quietly():
    done = _with_stdout_closed("--version")
    assert done.returncode in (0, 141) and done.stderr == ""  # argparse itself ignores the closed pipe


def test_list_of_an_unknown_name_fails_in_one_line(server, uploaded):
    status, out, err = run_cli("list", "no-such-adapter", *_flags(server))
    assert (status, out) == (1, "")
    assert err.startswith("error: NOT_FOUND: no adapter named 'no-such-adapter'") and err.count("\n") == 1
    assert run_cli("delete", "no-such-adapter", *_flags(server))[2].split(";")[0] == err.split(";")[0]
    status, out, err = run_cli("list", "sql", *_flags(server))
    assert status == 0, err
    refs = [line.split()[0] for line in out.splitlines()[1:]]
    assert uploaded["sql"] in refs and all(ref.startswith("sql@") for ref in refs)
