"""The command line's parsing, without building anything (pure: runs with --noconftest)."""
import pytest

from lab import cli
from lab.core.errors import UsageError


@pytest.mark.parametrize("argv", [["--values", "-0.5,0.3,1.2,0.1"],
                                  ["--values=-0.5,0.3,1.2,0.1"]])
def test_allreduce_takes_negative_values_in_either_spelling(argv):
    args = cli.build_parser().parse_args(["allreduce", *argv, "--transport", "mrc"])
    assert cli._values(args.values) == [-0.5, 0.3, 1.2, 0.1]
    assert args.transport == "mrc"


@pytest.mark.parametrize("text", ["-1", "-.5,2", "-1e-3,4E2,-7", "0.7,-0.9"])
def test_number_lists_that_start_with_a_minus_are_joined_to_their_option(text):
    args = cli.build_parser().parse_args(["allreduce", "--values", text])
    assert args.values == text


def test_a_bad_negative_list_gets_the_options_own_message():
    args = cli.build_parser().parse_args(["allreduce", "--values", "-0.5,abc"])
    with pytest.raises(UsageError, match="--values takes numbers separated by commas"):
        cli._values(args.values)


def test_an_option_after_values_is_still_an_option():
    # "--values --transport mrc": the value is missing, and argparse says so
    with pytest.raises(UsageError, match="--values: expected one argument"):
        cli.build_parser().parse_args(["allreduce", "--values", "--transport", "mrc"])


def test_nothing_after_a_double_dash_is_rewritten():
    argv = ["vm", "run", "--", "echo", "--values", "-1,2"]
    assert cli.join_number_lists(argv) == argv


def test_allreduce_help_says_negative_values_work(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["allreduce", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--values -0.5,0.3 or --values=-0.5,0.3" in text
