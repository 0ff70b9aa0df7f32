"""The flags `cli` defines for the commands (`define_workdir_flag`, `define_checkpoint_flag`,
`define_beam_rule_flag`) belong to the command that asks for them: its --help lists them."""

import subprocess
import sys

from conftest import REPO_ROOT


def test_a_commands_help_lists_the_flags_cli_defines_for_it():
  # A process of its own: --help is what a user types, and absl's flags are process-global.
  result = subprocess.run(
    [sys.executable, '-m', 'transformer_jax.translate', '--help'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  listed = {line.split(':')[0].strip() for line in result.stdout.splitlines() if ': ' in line}
  assert {'--workdir', '--checkpoint', '--beam_rule', '--input', '--output'} <= listed, listed
