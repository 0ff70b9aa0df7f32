"""Serves translations over HTTP, with dynamic batching:

    python -m transformer_jax.serve --workdir=DIR [--port=8000] [--engine=jax|ctranslate2]
    curl -s localhost:8000/v1/translate --json '{"text": ["one hundred"], "beam_size": 4}'
    curl -s localhost:8000/v1/translate --json '{"text": ["one"], "num_hypotheses": 2}'

POST /v1/translate, POST /v1/attention, GET /healthz, GET /metrics (JSON) and a page at / that
shows a translation and its cross-attention. Binds to 127.0.0.1 unless --host says otherwise;
every batch and sentence length is compiled at start-up. --engine=ctranslate2 exports the model
(int8 unless --quantization says otherwise) into the workdir, or reuses that export when it was
made from the same checkpoint, and has no attention maps. --dtype=bfloat16 (or float16) decodes
with the JAX engine in that dtype (the parameters cast once); CTranslate2 refuses it (its
precision is --quantization). SIGTERM drains and exits 0.
Requests must name the server in Host (--allowed_hosts adds names), come from no web page but
its own (--allowed_origins adds origins) and send JSON; --auth_token_file requires a bearer token
(the page: open it as /#token=...). Clients that stall are dropped (serving/guards.py).
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.exporters import ctranslate2_spec
from transformer_jax.serving import app, ctranslate2_engine, guards

FLAGS = flags.FLAGS


def _define_flags():
  defaults = app.ServerOptions()
  cli.define_workdir_flag()
  cli.define_checkpoint_flag()
  cli.define_dtype_flag()  # --engine=jax's; CTranslate2's precision is --quantization.
  flags.DEFINE_enum(
    'engine',
    'jax',
    app.ENGINES,
    'Decoding backend: jax, or ctranslate2 (the model exported at start-up; the [export] extra).',
  )
  flags.DEFINE_enum(
    'quantization',
    None,
    ctranslate2_spec.QUANTIZATIONS,
    f'ctranslate2: weight type (default {ctranslate2_engine.DEFAULT_QUANTIZATION}; float32 '
    'translates exactly as --engine=jax).',
  )
  flags.DEFINE_string(
    'ctranslate2_dir',
    None,
    'ctranslate2: the export folder, reused when made from the same checkpoint (default: '
    'inside the workdir).',
  )
  flags.DEFINE_integer(
    'intra_threads',
    None,
    f'ctranslate2: OpenMP threads (default {ctranslate2_engine.DEFAULT_THREADS}; more only on '
    'cores nothing else uses: see serving/ctranslate2_engine.py).',
  )
  flags.DEFINE_string('host', defaults.host, 'Address to listen on (0.0.0.0: every interface).')
  flags.DEFINE_integer('port', defaults.port, 'Port to listen on (0: any free port).')
  flags.DEFINE_integer('max_batch_size', defaults.max_batch_size, 'Sentences decoded together.')
  flags.DEFINE_float(
    'max_wait_ms', defaults.max_wait_ms, 'How long a request waits for others to batch with.'
  )
  flags.DEFINE_integer('max_queue', defaults.max_queue, 'Requests waiting before 503s.')
  flags.DEFINE_integer('max_sentences', defaults.max_sentences, 'Sentences per request.')
  flags.DEFINE_integer('max_chars', defaults.max_chars, 'Characters per sentence.')
  flags.DEFINE_float('timeout_s', defaults.timeout_s, 'Seconds a request may take before a 504.')
  flags.DEFINE_float(
    'header_timeout_s',
    defaults.header_timeout_s,
    'Seconds a connection has to send a request line and headers before it is closed.',
  )
  flags.DEFINE_float(
    'body_timeout_s', defaults.body_timeout_s, 'Seconds a request has to send its body (408).'
  )
  flags.DEFINE_string(
    'allowed_hosts',
    defaults.allowed_hosts,
    'Comma list of Host names served besides 127.0.0.1, localhost, [::1] and --host (e.g. the '
    "machine's LAN name); * allows any, which lets DNS rebinding through: unsafe.",
  )
  flags.DEFINE_string(
    'allowed_origins',
    defaults.allowed_origins,
    'Comma list of web origins (http://host:port) whose pages may call the server, besides '
    'its own page.',
  )
  flags.DEFINE_string(
    'auth_token_file',
    None,
    'A file holding a bearer token that every request but / and /healthz must send '
    f'(Authorization: Bearer ...); default: ${guards.TOKEN_VARIABLE}, else none.',
  )
  flags.DEFINE_string(
    'decoding',
    defaults.decoding,
    'The modes requests may use, all compiled at start-up; the first is the default. Comma '
    'list of beam_size:alpha pairs (1 = greedy; n-best lists and MBR over them included) and '
    'sampling entries, sampling[:topk=K+K...][:draws=N+N...][:temperature][:topp]: the top-k '
    'values (default 0: none) and draws per text (num_hypotheses, or mbr N; default 1) '
    'allowed, temperature/topp: any value, else 1 (each a program of its own); :prefix after '
    'any entry allows target_prefix with it. E.g. 4:0.6:prefix,1:0,sampling:topk=0+40:draws=1+8',
  )
  flags.DEFINE_integer(
    'max_hypotheses',
    defaults.max_hypotheses,
    'Most hypotheses a request may ask for per text (num_hypotheses; beam search: <= beam_size).',
  )
  flags.DEFINE_integer(
    'max_mbr', defaults.max_mbr, 'Most MBR candidates a request may ask for per text (mbr).'
  )
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  del argv
  options = app.ServerOptions(
    host=FLAGS.host,
    port=FLAGS.port,
    max_batch_size=FLAGS.max_batch_size,
    max_wait_ms=FLAGS.max_wait_ms,
    max_queue=FLAGS.max_queue,
    max_sentences=FLAGS.max_sentences,
    max_chars=FLAGS.max_chars,
    timeout_s=FLAGS.timeout_s,
    decoding=FLAGS.decoding,
    max_hypotheses=FLAGS.max_hypotheses,
    max_mbr=FLAGS.max_mbr,
    header_timeout_s=FLAGS.header_timeout_s,
    body_timeout_s=FLAGS.body_timeout_s,
    allowed_hosts=FLAGS.allowed_hosts,
    allowed_origins=FLAGS.allowed_origins,
    auth_token_file=FLAGS.auth_token_file,
    quantization=FLAGS.quantization,
    ctranslate2_dir=FLAGS.ctranslate2_dir,
    intra_threads=FLAGS.intra_threads,
    dtype=FLAGS.dtype,
  )
  app.serve(
    FLAGS.workdir,
    checkpoint=cli.checkpoint_flag_value(FLAGS.checkpoint),
    engine=FLAGS.engine,
    options=options,
  )


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
