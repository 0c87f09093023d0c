"""The command line's key=value overrides may follow options (megatron_gspo/cli.py parse_args)."""
import pytest

from megatron_gspo.cli import parse_args


def test_overrides_after_an_option_join_the_ones_before_it():
    args = parse_args(["eval", "c.yaml", "a=1", "--checkpoint", "ckpt", "b.c=2", "d=[]"])
    assert (args.config, args.checkpoint, args.overrides) == ("c.yaml", "ckpt", ["a=1", "b.c=2", "d=[]"])
    args = parse_args(["train", "c.yaml", "--nnodes", "2", "--master-port", "9", "num_steps=3"])
    assert (args.nnodes, args.overrides) == (2, ["num_steps=3"])
    assert parse_args(["eval", "--checkpoint", "ckpt", "c.yaml", "a=1"]).overrides == ["a=1"]


@pytest.mark.parametrize("argv", [["eval", "c.yaml", "--checkpoint", "ckpt", "--bogus"],  # an unknown option
                                  ["eval", "c.yaml", "--checkpoint", "ckpt", "stray"],     # not key=value
                                  ["plot", "run", "a=1"]])                                 # no overrides there
def test_anything_else_left_over_is_still_refused(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
