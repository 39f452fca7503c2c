"""Fine-tune a "pretrained" GPT-2 with peft LoRA through flexpar: frozen weights never travel.

    pip install -e ".[hf]"                            # transformers and peft
    python examples/lora_gpt.py --steps 80            # every local device, or one CPU process
    flexpar run --devices 2 --max-devices 3 --oversubscribe --schedule 10:+1,70:-1 \\
        --checkpoint-dir runs/lora-ck --checkpoint-every 20 examples/lora_gpt.py   # 80 steps
    flexpar export runs/lora-ck/step-00000080.pt -o runs/lora.safetensors   # + runs/lora-adapter/

The script first writes a small GPT-2 checkpoint to --pretrained (nothing is
downloaded), then trains LoRA adapters on its attention with bf16 autocast,
clipping at 1.0 and the token-weighted loss. The base weights are frozen:
every device loads them from its own files, joiners receive only the adapters
and their optimizer state, and checkpoints hold those plus the frozen weights'
digests. The pieces live in flexpar/examples/lora_gpt.py.
"""

from flexpar.examples.lora_gpt import main as run_example


def main():
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit(
            'examples/lora_gpt.py needs transformers and peft: pip install -e ".[hf]" in flexpar\'s checkout'
        ) from None
    run_example()


# Worker processes import this script; the guard keeps them from training again.
if __name__ == "__main__":
    main()
