"""Train a small CNN on scikit-learn's handwritten digits, data-parallel with flexpar.

    python examples/digits.py --steps 200            # every local device, or one CPU process
    flexpar run --devices 2 examples/digits.py       # two devices
    flexpar run --devices 2 --schedule 50:+1,120:-1 --oversubscribe examples/digits.py

The pieces below are ordinary single-device PyTorch code; they live in
flexpar/examples/digits.py, which is worth reading next to this file. They are
defined at module level there because worker processes import them by name.
"""

import flexpar
from flexpar.examples.digits import evaluate, load_splits, loss_fn, make_model, make_optimizer, parse_arguments


def main():
    arguments = parse_arguments()  # --steps --devices --schedule --global-batch --virtual-workers --seed
    train, held_out = load_splits()  # TensorDatasets of (image [1, 8, 8] in [0, 1], label)

    job = flexpar.Job(
        model=make_model,  # zero-argument factory -> nn.Module
        optimizer=make_optimizer,  # parameters -> torch.optim.Optimizer
        loss=loss_fn,  # loss_fn(model, batch) -> mean loss of the batch
        dataset=train,
        global_batch=arguments.global_batch,  # samples per step, whatever the device count
        virtual_workers=arguments.virtual_workers,  # the global batch is cut into this many parts
        seed=arguments.seed,
    )
    # `flexpar run` flags (--devices, --schedule, ...) override these arguments.
    model, summary = job.fit(steps=arguments.steps, devices=arguments.devices, schedule=arguments.schedule)
    print(f"held-out accuracy: {evaluate(model, held_out):.3f}, final training loss {summary['final_loss']:.3f}")


# Worker processes import this script; the guard keeps them from training again.
if __name__ == "__main__":
    main()
