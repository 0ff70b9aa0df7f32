"""Hostile files from outside (issue 26, item 3): every file `import_marian` reads from the user
(the .npz and its special:model.yml, the vocabulary .yml/.json/.spm, the .spm that segments,
decoder.yml) is read within bounds, and whatever is wrong with it is one `UserInputError` line
naming the file (and the member), exit 2, with nothing written into the target workdir.

The "billion laughs" is a dozen lines of YAML: level i is a list of nine aliases of level i-1,
9^12 leaves to anything that walks the result (json.dumps of the options, a comparison).
"""

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

from transformer_jax.common.errors import UserInputError
from transformer_jax.importers import workdir_writer
from transformer_jax.testing import marian_npz

from conftest import REPO_ROOT

VOCAB = 10
DIMS = dict(vocab_size=VOCAB, d_model=8, d_ff=16, heads=2, encoder_layers=1, decoder_layers=1)
# The command's own imports (JAX, Flax) take ~200 MiB; HEAD's bomb passed 1.5 GiB in 20 s.
COMMAND_RSS_LIMIT_MIB = 600
COMMAND_KILLED_AFTER_S = 20


def _laughs(levels: int = 12, indent: str = '') -> str:
  """YAML lines whose last list is 9**levels leaves (here 282 billion) in ~60 bytes a level."""
  lines = [f'{indent}- &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]']
  lines += [f'{indent}- &l{i} [' + ', '.join([f'*l{i - 1}'] * 9) + ']' for i in range(1, levels)]
  return '\n'.join(lines) + '\n'


def _options_text(**changes) -> str:
  """The tiny model's special:model.yml as Marian writes it, with `changes`."""
  return marian_npz.marian_yaml({**marian_npz.marian_model_config(**DIMS), **changes})


def _with_meta(text: str) -> dict:
  return {'special:model.yml': marian_npz.marian_meta_array(text)}


def _bomb_options() -> str:
  """The bomb under `special-vocab`, an option the importer ignores: nothing but the YAML
  reading stands between it and json.dumps of the options into the workdir's config.json."""
  return _options_text().replace(
    'skip: false', 'skip: false\nspecial-vocab:\n' + _laughs(indent='  ')
  )


@pytest.fixture(scope='module')
def spm(tmp_path_factory) -> str:
  """A real SentencePiece model as Marian trains one (a fraction of a second)."""
  prefix = str(tmp_path_factory.mktemp('spm') / 'source')
  text = ['the cat sat on the mat', 'two dogs ran over green hills'] * 50
  marian_npz.train_sentencepiece(prefix, text, 30)
  os.rename(prefix + '.model', prefix + '.spm')
  return prefix + '.spm'


@pytest.fixture
def model(tmp_path):
  """(npz path, its arrays, vocab.yml path) of a tiny random Marian model."""
  npz = str(tmp_path / 'model.npz')
  arrays = marian_npz.write_random_marian_npz(npz, **DIMS, seed=0)
  vocab = marian_npz.write_vocab_yml(tmp_path / 'vocab.yml', marian_npz.make_tokens(VOCAB))
  return npz, arrays, vocab


def _npy(array: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  np.save(buffer, array)
  return buffer.getvalue()


def _zip(path: str, members: dict[str, bytes], method=zipfile.ZIP_STORED) -> None:
  with zipfile.ZipFile(path, 'w', method) as archive:
    for name, data in members.items():
      archive.writestr(name, data)


def _members(arrays: dict, **changes) -> dict[str, bytes]:
  """Each array as a .npy member; `changes` (name -> bytes, or an array) replace or add."""
  members = {f'{k}.npy': _npy(v) for k, v in arrays.items()}
  for name, value in changes.items():
    members[f'{name}.npy'] = value if isinstance(value, bytes) else _npy(value)
  return members


def _npy_header(shape, descr='<f4') -> bytes:
  buffer = io.BytesIO()
  header = {'descr': descr, 'fortran_order': False, 'shape': shape}
  np.lib.format.write_array_header_1_0(buffer, header)
  return buffer.getvalue()


def _flip_byte_inside(path: str, data: bytes) -> None:
  """One byte of the stored member whose bytes include `data` changed: its CRC fails."""
  raw = bytearray(open(path, 'rb').read())
  raw[raw.index(data) + len(data) // 2] ^= 0xFF
  open(path, 'wb').write(bytes(raw))


def _mark_encrypted(path: str) -> None:
  """Every member flagged encrypted (bit 0 of the flags, byte 8 of its central directory entry)."""
  raw = bytearray(open(path, 'rb').read())
  at = raw.find(b'PK\x01\x02')
  while at >= 0:
    raw[at + 8] |= 1
    at = raw.find(b'PK\x01\x02', at + 4)
  open(path, 'wb').write(bytes(raw))


def _deflated_zeros(path: str, arrays: dict, name: str, shape) -> None:
  """The model with member `name` replaced by deflated zeros of `shape`, written a MiB at a
  time: a real zip bomb, ~1000 times smaller than it inflates."""
  with zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED) as archive:
    for key, data in _members(arrays).items():
      if key != f'{name}.npy':
        archive.writestr(key, data)
    with archive.open(f'{name}.npy', 'w', force_zip64=True) as member:
      member.write(_npy_header(shape))
      size = int(np.prod(shape)) * 4
      for start in range(0, size, 1 << 20):
        member.write(bytes(min(1 << 20, size - start)))


W1 = 'encoder_l1_ffn_W1'  # [8, 16] here
# name -> (how the model's .npz is damaged: f(npz path, arrays), what the one line says after
# the path). None costs 20 MB: nothing is inflated past what the headers declare and the
# options allow.
DAMAGED_NPZ = {
  'truncated': (
    lambda p, a: _truncate(p, 5000),
    r'not a Marian \.npz model \(File is not a zip file\)',
  ),
  'member whose CRC fails': (
    lambda p, a: _flip_byte_inside(p, a[W1].tobytes()),
    rf"member {W1}\.npy is damaged \(Bad CRC-32 for file '{W1}\.npy'\)",
  ),
  'member that is not a .npy': (
    lambda p, a: _zip(p, _members(a, **{W1: b'not an array at all'})),
    rf'member {W1}\.npy is damaged \(the magic string is not correct',
  ),
  'member with a broken .npy header': (
    lambda p, a: _zip(p, _members(a, **{W1: b'\x93NUMPY\x01\x00\x10\x00[1, 2, 3]      \n'})),
    rf'member {W1}\.npy is damaged \(Header is not a dictionary',
  ),
  'member declaring 4 TB in 64 bytes': (
    lambda p, a: _zip(p, _members(a, **{W1: _npy_header((10**6, 10**6)) + bytes(64)})),
    rf'member {W1}\.npy declares float32\[1000000, 1000000\] \(4000000000000 bytes\) but holds '
    r'64 bytes',
  ),
  'member whose deflate data is damaged': (
    lambda p, a: (_zip(p, _members(a), zipfile.ZIP_DEFLATED), _damage_deflate(p, f'{W1}.npy')),
    rf'member {W1}\.npy is damaged \(Error -3 while decompressing data',
  ),
  'encrypted member': (
    lambda p, a: (_zip(p, _members(a)), _mark_encrypted(p)),
    r'member Wemb\.npy is encrypted',
  ),
  'bzip2 member (np.load would inflate it)': (
    lambda p, a: _zip(p, _members(a), zipfile.ZIP_BZIP2),
    r'member Wemb\.npy is compressed with zip method 12 \(only stored or deflated\)',
  ),
  'deflate bomb: 65 MiB of zeros in 80 KB': (
    lambda p, a: _deflated_zeros(p, a, W1, (8, 65 << 15)),
    r'its members inflate to \d+ bytes, more than 16 times the file\'s \d+ \(a zip bomb',
  ),
  'a plain-looking tensor 2 million times too large for the options': (
    lambda p, a: _deflated_zeros(p, a, W1, (8, 1 << 20)),  # 32 MiB: under the allowance.
    rf'tensor {W1} has shape \[8, 1048576\], expected \[8, 16\]',
  ),
  'member that is not a .npy file': (
    lambda p, a: _zip(p, {**_members(a), 'README': b'hello'}),
    r'member README is not a \.npy array',
  ),
  'two members of one name': (
    lambda p, a: (_zip(p, _members(a)), _append_member(p, f'{W1}.npy', _npy(a[W1]))),
    rf'member {W1}\.npy appears twice',
  ),
  'enc-depth of a billion layers': (
    lambda p, a: _zip(p, _members(a, **_with_meta(_options_text(**{'enc-depth': 10**9})))),
    r'options enc-depth, dec-depth: more layers than the file has tensors \(44\)',
  ),
  'an option name that is a number': (
    lambda p, a: _zip(p, _members(a, **_with_meta(_options_text() + '\n1: 2'))),
    r'special:model\.yml: option name 1 is not text',
  ),
  'a 5000-digit integer': (
    lambda p, a: _zip(
      p, _members(a, **_with_meta(_options_text().replace('dim-emb: 8', 'dim-emb: ' + '7' * 5000)))
    ),
    r'special:model\.yml: not valid YAML \(Exceeds the limit \(4300 digits\)',
  ),
  'options nested 20 deep': (
    lambda p, a: _zip(p, _members(a, **_with_meta(_options_text() + '\nx: ' + '[' * 20))),
    r'special:model\.yml: line \d+: nested deeper than 16 levels',
  ),
  'options nested 60000 deep (libyaml stops at 1000)': (
    lambda p, a: _zip(p, _members(a, **_with_meta(_options_text() + '\nx: ' + '[' * 60_000))),
    r'special:model\.yml: (line \d+: nested deeper than 16 levels|not valid YAML)',
  ),
}


def _a_folder_at(path) -> str:
  """A folder where a file is expected (not the test's own folder: the workdir goes there, and
  a workdir inside an input folder is refused before the input is read)."""
  os.makedirs(path)
  return str(path)


def _truncate(path: str, size: int) -> None:
  data = open(path, 'rb').read()
  open(path, 'wb').write(data[:size])


def _damage_deflate(path: str, name: str) -> None:
  """Twenty bytes of the deflated member `name` scrambled (past its first few)."""
  with zipfile.ZipFile(path) as archive:
    info = archive.getinfo(name)
  raw = bytearray(open(path, 'rb').read())
  start = info.header_offset + 30 + len(name) + len(info.extra) + 8
  for i in range(start, start + 20):
    raw[i] ^= 0x55
  open(path, 'wb').write(bytes(raw))


def _append_member(path: str, name: str, data: bytes) -> None:
  with zipfile.ZipFile(path, 'a') as archive, pytest.warns(UserWarning, match='Duplicate name'):
    archive.writestr(name, data)


def _refused(call, tmp_path) -> tuple[str, float, float]:
  """(message, seconds, peak MB traced) of `call()`, which must raise a one-line
  UserInputError and leave the workdir unwritten."""
  tracemalloc.start()
  start = time.perf_counter()
  try:
    with pytest.raises(UserInputError) as error:
      call()
  finally:
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
  message = str(error.value)
  assert '\n' not in message and not os.path.exists(tmp_path / 'workdir')
  return message, seconds, peak


def _import(tmp_path, model, vocab, spm=None):
  workdir = str(tmp_path / 'workdir')
  return lambda: workdir_writer.import_marian_model(model, workdir, vocab=vocab, spm=spm)


def test_an_alias_bomb_in_the_options_is_refused_in_milliseconds_and_kilobytes(model, tmp_path):
  """In the library; the command is tested below. No .spm is needed: the options are read
  first (with a real one, HEAD would hang here; the command's test kills HEAD's run)."""
  npz, arrays, vocab = model
  np.savez(npz, **{**arrays, **_with_meta(_bomb_options())})
  assert os.path.getsize(npz) < 40_000
  message, seconds, peak = _refused(
    _import(tmp_path, npz, vocab, str(tmp_path / 'x.spm')), tmp_path
  )
  print(f'alias bomb refused in {seconds * 1000:.1f} ms, peak {peak:.2f} MB traced')
  assert message.startswith(f'{npz}: special:model.yml: line ')
  assert 'YAML anchors and aliases (&name, *name) are refused' in message
  assert seconds < 1.0 and peak < 5.0


@pytest.mark.parametrize('name', list(DAMAGED_NPZ))
def test_a_damaged_npz_is_one_line_naming_file_and_member(name, model, tmp_path):
  npz, arrays, vocab = model
  damage, expected = DAMAGED_NPZ[name]
  damage(npz, arrays)
  message, seconds, peak = _refused(
    _import(tmp_path, npz, vocab, str(tmp_path / 'x.spm')), tmp_path
  )
  assert message.startswith(f'{npz}: ')
  assert re.search(f'^{re.escape(npz)}: {expected}', message), message
  assert peak < 20.0, f'{peak:.1f} MB traced: a member was inflated'  # The model is 10 KB.


def test_a_deflated_model_reads_as_the_stored_one(model):
  """np.savez_compressed's deflate stays readable: the bounds refuse bombs, not compression."""
  from transformer_jax.importers import marian

  npz, arrays, _ = model
  compressed = npz.replace('model.npz', 'compressed.npz')
  np.savez_compressed(compressed, **arrays)
  options, layout, tensors, vocab_size = marian.read_npz(compressed)
  assert vocab_size == VOCAB and layout['d_model'] == 8 and options['dim-emb'] == 8
  assert tensors.keys() == arrays.keys() - {'special:model.yml'}
  for name, tensor in tensors.items():
    np.testing.assert_array_equal(tensor, arrays[name])


def _folder(tmp_path, model, spm, decoder_yml: str) -> tuple:
  """An OPUS-MT folder (model.npz, vocab.yml, source.spm) with this decoder.yml: (the folder,
  no --vocab, no --spm, its decoder.yml)."""
  npz, _, vocab = model
  folder = tmp_path / 'opus'
  folder.mkdir()
  for path in (npz, vocab, spm):
    (folder / os.path.basename(path)).write_bytes(open(path, 'rb').read())
  (folder / 'decoder.yml').write_text(decoder_yml)
  return str(folder), None, None, str(folder / 'decoder.yml')


def _spm_not_utf8(path, spm: str) -> str:
  """The .spm with its first '\u2581' (UTF-8 e2 96 81) made a5 96 81, which is not UTF-8."""
  path.write_bytes(open(spm, 'rb').read().replace('\u2581'.encode(), b'\xa5\x96\x81', 1))
  return str(path)


# name -> (f(tmp_path, (npz, arrays, vocab.yml), spm) -> (import_marian_model's model, vocab,
# spm, the file the error must name), what the line then says).
HOSTILE_FILES = {
  'vocab.yml anchor': (
    lambda t, m, s: (m[0], _write(t / 'v.yml', '</s>: &a 0\n*a : 1\n'), s, str(t / 'v.yml')),
    'line 1: YAML anchors and aliases (&name, *name) are refused',
  ),
  'vocab.yml a folder': (
    lambda t, m, s: (m[0], _a_folder_at(t / 'v.yml'), s, str(t / 'v.yml')),
    'not a regular file (a vocabulary is expected)',
  ),
  'vocab.yml larger than any vocabulary': (
    lambda t, m, s: (m[0], _huge(t / 'v.yml'), s, str(t / 'v.yml')),
    'larger than 16 MiB, more than any vocabulary',
  ),
  'spm a folder': (
    lambda t, m, s: (m[0], m[2], _a_folder_at(t / 's.spm'), str(t / 's.spm')),
    'not a regular file (a SentencePiece model is expected)',
  ),
  'spm a device that never ends': (
    lambda t, m, s: (m[0], m[2], '/dev/zero', '/dev/zero'),
    'not a regular file (a SentencePiece model is expected)',
  ),
  'spm larger than any vocabulary': (
    lambda t, m, s: (m[0], m[2], _huge(t / 'big.spm'), str(t / 'big.spm')),
    'larger than 16 MiB, more than any SentencePiece model',
  ),
  'spm whose piece is not UTF-8': (
    lambda t, m, s: (m[0], m[2], _spm_not_utf8(t / 'bad.spm', s), str(t / 'bad.spm')),
    'not a SentencePiece model (piece ',
  ),
  'decoder.yml alias bomb': (
    lambda t, m, s: _folder(t, m, s, 'models:\n' + _laughs()),
    'line 2: YAML anchors and aliases (&name, *name) are refused',
  ),
  'decoder.yml a list': (
    lambda t, m, s: _folder(t, m, s, '- model.npz\n'),
    "not a YAML map of settings (['model.npz'])",
  ),
  'decoder.yml models as a string': (
    lambda t, m, s: _folder(t, m, s, 'models: model.npz\n'),
    "models must be a list of file names, got 'model.npz'",
  ),
  'decoder.yml naming a device as vocabulary': (
    lambda t, m, s: (
      _folder(t, m, s, 'models: [model.npz]\nvocabs: [vocab.yml, /dev/zero]\n')[:3] + ('/dev/zero',)
    ),
    'not a regular file (a vocabulary is expected)',
  ),
}


def _write(path, text: str) -> str:
  path.write_text(text)
  return str(path)


def _huge(path) -> str:
  """A sparse file one byte over the 16 MiB cap (no disk used, nothing of it read)."""
  with open(path, 'wb') as f:
    f.truncate((16 << 20) + 1)
  return str(path)


@pytest.mark.parametrize('name', list(HOSTILE_FILES))
def test_hostile_vocabularies_and_decoder_yml_are_one_line_naming_the_file(
  name, model, spm, tmp_path
):
  build, says = HOSTILE_FILES[name]
  npz, vocab, spm_path, named = build(tmp_path, model, spm)
  message, seconds, peak = _refused(_import(tmp_path, npz, vocab, spm_path), tmp_path)
  assert message.startswith(f'{named}: ') and says in message, message
  assert seconds < 2.0 and peak < 20.0, (seconds, peak)


@pytest.mark.parametrize(
  'text, says',
  [
    (_laughs(), 'line 1: YAML anchors and aliases'),
    ('a: &x 1\n', 'line 1: YAML anchors and aliases'),
    ('a: ' + '[' * 17 + ']' * 17, 'line 1: nested deeper than 16 levels'),
    ('a: [1, 2\n', 'not valid YAML (while parsing a flow sequence'),
    ('a: ' + '7' * 5000, 'not valid YAML (Exceeds the limit (4300 digits)'),
    ('a: 2001-13-45', 'not valid YAML (month must be in 1..12)'),
    ('a: 1\n---\nb: 2\n', 'not valid YAML (expected a single document'),
  ],
  ids=['alias bomb', 'anchor', 'deep', 'syntax', 'huge integer', 'bad date', 'two documents'],
)
def test_bounded_yaml_refuses_what_could_run_away_in_one_line(text, says):
  from transformer_jax.importers import bounded_yaml

  with pytest.raises(UserInputError) as error:
    bounded_yaml.load(text, 'options.yml')
  assert str(error.value).startswith('options.yml: ') and says in str(error.value)
  assert '\n' not in str(error.value)


def test_bounded_yaml_reads_marian_s_options_as_yaml_safe_load_does():
  import yaml

  from transformer_jax.importers import bounded_yaml

  text = _options_text(**{'transformer-tied-layers': [1, 2], 'version': 'v1.12.3 ab'})
  assert bounded_yaml.load(text, 'x') == yaml.safe_load(text)
  assert len(text) < bounded_yaml.MAX_OPTIONS_BYTES // 20  # The cap leaves room to spare.


def _run_measured(command: list[str]) -> tuple[int, str, float, float]:
  """(exit status, stderr, seconds, peak RSS in MiB) of `command`, killed after
  COMMAND_KILLED_AFTER_S. The peak is the process's own VmHWM, sampled every 20 ms: wait4's
  ru_maxrss would also count the peak of this (pytest) process, which exec carries over."""
  with tempfile.TemporaryFile('w+') as stderr:
    start, peak_kib = time.monotonic(), 0
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO_ROOT)
    while process.poll() is None and time.monotonic() - start < COMMAND_KILLED_AFTER_S:
      with contextlib.suppress(OSError), open(f'/proc/{process.pid}/status') as status:
        peak_kib = max([peak_kib] + [int(s.split()[1]) for s in status if s.startswith('VmHWM')])
      time.sleep(0.02)
    if process.poll() is None:
      process.kill()
    process.wait()
    stderr.seek(0)
    return process.returncode, stderr.read(), time.monotonic() - start, peak_kib / 1024


@pytest.mark.parametrize('damage', ['alias bomb', 'bad CRC'])
def test_the_command_ends_in_one_line_exit_2_and_writes_no_workdir(damage, model, spm, tmp_path):
  """The real `python -m transformer_jax.import_marian`, with a real vocabulary and .spm: HEAD
  hangs on the bomb (> 1.1 GB after 120 s) and prints a traceback for the bad CRC."""
  npz, arrays, vocab = model
  if damage == 'alias bomb':
    np.savez(npz, **{**arrays, **_with_meta(_bomb_options())})
  else:
    _flip_byte_inside(npz, arrays[W1].tobytes())
  workdir = str(tmp_path / 'workdir')
  command = [sys.executable, '-m', 'transformer_jax.import_marian', f'--model={npz}']
  command += [f'--vocab={vocab}', f'--spm={spm}', f'--workdir={workdir}']
  status, stderr, seconds, rss = _run_measured(command)
  print(f'{damage}: exit {status} in {seconds:.1f} s, peak RSS {rss:.0f} MiB: {stderr.strip()}')
  assert status == 2, stderr[-2000:]
  assert len(stderr.strip().splitlines()) == 1 and stderr.startswith(f'error: {npz}: ')
  assert ('special:model.yml' if damage == 'alias bomb' else f'member {W1}.npy') in stderr
  assert not os.path.exists(workdir)
  assert seconds < COMMAND_KILLED_AFTER_S and rss < COMMAND_RSS_LIMIT_MIB
