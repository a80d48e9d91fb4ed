"""A grammar whose rules form a long chain (within MAX_SPEC_CHARS) made llguidance recurse past
a thread's default 8 MiB stack while building its matcher, and the server process died
(SIGSEGV). It is built on a thread with a big stack now; the grammar is then used on an
ordinary one. Run in a child process, so that a crash is a failure rather than the end of
the test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import gc
    import itertools
    import string
    import threading

    from argosy_runtime.model_loader import load_checkpoint
    from argosy_runtime.structured_output import StructuredOutputsParams
    from argosy_runtime.structured_output.grammar import GrammarCompiler

    ck = load_checkpoint("smollm2-135m")
    tok = ck.tokenizer
    names = ["".join(t) for k in (1, 2, 3)
             for t in itertools.product(string.ascii_lowercase, repeat=k)]
    n = 4000  # crashed from about 2,800
    lark = StructuredOutputsParams(grammar="start: a\\n" + "\\n".join(
        f"{names[i]}: {names[i + 1]}" for i in range(n)) + f'\\n{names[n]}: "end"')
    m = 3000
    defs = {names[i]: {"$ref": f"#/$defs/{names[i + 1]}"} for i in range(m)}
    defs[names[m]] = {"type": "integer"}
    refs = StructuredOutputsParams(json={"$ref": "#/$defs/a", "$defs": defs})

    def run():
        compiler = GrammarCompiler(tok, ck.spec.vocab_size, tok.eos_token_ids, cache_size=1)
        for params, text in ((lark, "end"), (refs, "12")):
            compiler.check(params)  # as the server does, in a worker thread
            grammar = compiler.compile(params)  # as the engine does
            out = []
            for token in tok.encode(text, add_special_tokens=False):
                assert grammar.allowed_tokens(out)[token]
                out.append(token)
            assert grammar.error(out) is None
            del grammar
            gc.collect()
        compiler._cache.clear()
        gc.collect()
        print("survived")

    thread = threading.Thread(target=run)  # a default stack, as asyncio's worker threads
    thread.start()
    thread.join()
''')


def test_a_long_chain_of_rules_does_not_kill_the_process() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "survived" in proc.stdout
