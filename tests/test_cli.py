"""The ``rft-jax`` command line."""

from rft_jax import cli


def test_verify_passes_and_prints_every_identity(capsys):
  assert cli.main(["verify", "--cases", "64", "--vocab", "16"]) == 0
  out = capsys.readouterr().out
  for name in cli.VERIFY_TOLERANCES:
    assert name in out
  assert " NO" not in out


def test_unknown_subcommand_is_an_error(capsys):
  try:
    cli.main(["no-such-command"])
  except SystemExit as exc:
    assert exc.code == 2
  else:
    raise AssertionError("argparse accepted an unknown subcommand")
  assert "no-such-command" in capsys.readouterr().err
