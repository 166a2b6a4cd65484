"""torch must never be needed at run time: load the embedded SmolLM2 target (GGUF + tokenizer) and
generate with torch made unimportable, as on a machine that installed only requirements.txt."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    sys.modules["torch"] = None  # `import torch` fails and find_spec("torch") is None: not installed
    from dflash_jax import generate, load_target

    target = load_target("smollm2", "float32")  # the embedded target by name
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    result = generate(target, None, [ids], max_new_tokens=3)
    assert sys.modules["torch"] is None
    print("generated", len(result.tokens[0]), "tokens:", target.tokenizer.decode(result.tokens[0]))
""")


def test_smollm2_loads_and_generates_without_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "generated" in out.stdout
