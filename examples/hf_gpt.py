"""Train a small Hugging Face GPT-2 on the Python standard library's source with flexpar's recipes.

    pip install -e ".[hf]"                            # transformers (the model is built, not downloaded)
    python examples/hf_gpt.py --steps 200             # every local device, or one CPU process
    flexpar run --devices 2 examples/hf_gpt.py        # two devices
    flexpar run --devices 2 --schedule 100:+1 --oversubscribe examples/hf_gpt.py

The recipe of a real language-model run: bf16 autocast, gradient clipping at
1.0 (HF Trainer's default), and a token-weighted loss - `loss_fn` returns the
summed loss of the real (non-padding) tokens and their count, so the gradient
is the mean over every real token of the global batch, whatever the device set.
The pieces live in flexpar/examples/hf_gpt.py (module level, because worker
processes import them by name); the data is tiny_lm's text, cut at line breaks.
"""

from flexpar.examples.hf_gpt import (
    bits_per_byte,
    evaluate,
    job_from_arguments,
    load_splits,
    parse_arguments,
    sample,
)


def main():
    try:
        import transformers  # noqa: F401  (the model is built from it in every worker)
    except ImportError:
        raise SystemExit(
            'examples/hf_gpt.py needs Hugging Face transformers: pip install -e ".[hf]" in flexpar\'s checkout'
        ) from None
    # --steps --devices --schedule --global-batch --virtual-workers --max-bytes --mixed-precision
    # --max-grad-norm --compile --seed
    arguments = parse_arguments()
    train, held_out = load_splits(max_bytes=arguments.max_bytes)  # 64-byte windows cut after their last line break

    # The example's own job (flexpar.examples.hf_gpt.build_job; one copy, which the tests train):
    #   model=make_model          GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, ...)): random init
    #   optimizer=make_optimizer  AdamW, with a warm-up and cosine decay (lr_scheduler=WarmupCosine)
    #   loss=loss_fn              (summed token loss, number of real tokens): padding excluded from both
    #   mixed_precision="bf16", max_grad_norm=1.0 (HF Trainer's default), compile=--compile
    job = job_from_arguments(arguments, train)
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)

    loss = evaluate(model, held_out, max_windows=2000)
    print(f"held-out loss {loss:.3f} nats/byte = {bits_per_byte(loss):.3f} bits/byte (uniform: 8 bits/byte)")
    print("def " + sample(model, "def ", 120).decode("utf-8", errors="replace"))


# Worker processes import this script; the guard keeps them from training again.
if __name__ == "__main__":
    main()
