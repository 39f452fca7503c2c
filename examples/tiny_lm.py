"""Train a byte-level transformer on the Python standard library's source with flexpar.

    python examples/tiny_lm.py --steps 300            # every local device, or one CPU process
    flexpar run --devices 2 examples/tiny_lm.py       # two devices
    flexpar run --devices 2 --schedule 100:+1 --oversubscribe examples/tiny_lm.py

The pieces below are ordinary single-device PyTorch code; they live in
flexpar/examples/tiny_lm.py, which is worth reading next to this file. They are
defined at module level there because worker processes import them by name.
"""

import flexpar
from flexpar.examples.tiny_lm import (
    WarmupCosine,
    bits_per_byte,
    evaluate,
    load_splits,
    loss_fn,
    make_model,
    make_optimizer,
    parse_arguments,
    sample,
)


def main():
    arguments = parse_arguments()  # --steps --devices --schedule --global-batch --virtual-workers --max-bytes --seed
    train, held_out = load_splits(max_bytes=arguments.max_bytes)  # windows of 64 bytes and their next bytes

    job = flexpar.Job(
        model=make_model,  # zero-argument factory -> nn.Module
        optimizer=make_optimizer,  # parameters -> torch.optim.AdamW
        loss=loss_fn,  # next-byte cross-entropy in nats, averaged over the batch
        dataset=train,
        global_batch=arguments.global_batch,
        virtual_workers=arguments.virtual_workers,
        seed=arguments.seed,
        # optimizer -> scheduler; an object rather than a lambda, so that it pickles.
        # The schedule's length is the script's --steps: under `flexpar run`, give the steps to the
        # script (`flexpar run --devices 2 examples/tiny_lm.py -- --steps N`), not as flexpar's --steps.
        lr_scheduler=WarmupCosine(total_steps=arguments.steps, warmup_steps=min(20, arguments.steps)),
    )
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)

    loss = evaluate(model, held_out)
    print(f"held-out loss {loss:.3f} nats/byte = {bits_per_byte(loss):.3f} bits/byte (uniform: 8 bits/byte)")
    print("def " + sample(model, "def ", 120).decode("utf-8", errors="replace"))


# Worker processes import this script; the guard keeps them from training again.
if __name__ == "__main__":
    main()
