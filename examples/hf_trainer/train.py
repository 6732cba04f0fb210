"""A tiny GPT-2 built from its config (nothing downloaded) on generated token sequences, trained by
Hugging Face's Trainer under the toolkit's guarantees through hpc.hf (its Trainer in place of
transformers')."""

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from hpc.hf import Trainer

VOCAB, LENGTH = 64, 32


class Progressions(torch.utils.data.Dataset):
    """Sequences counting up from a random start by a random stride (mod VOCAB): the next token
    is predictable from the two before it, so the loss falls within a few hundred steps."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def next_token_accuracy(evaluated) -> dict[str, float]:
    predicted, labels = evaluated.predictions, evaluated.label_ids
    return {"acc": float((predicted[:, :-1] == labels[:, 1:]).mean())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=50, help="optimizer steps between evaluations (0: after each epoch)")
    parser.add_argument("--train-size", type=int, default=4096, help="training sequences (an epoch: this / 16 / ranks steps)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    training = TrainingArguments(
        output_dir=os.path.join(os.environ.get("HPCTK_RUN_DIR", "."), "hf_output"),
        max_steps=args.max_steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        learning_rate=args.lr,
        warmup_steps=10,
        eval_strategy="steps" if args.eval_every else "epoch",
        eval_steps=args.eval_every or None,
        logging_steps=10,
        save_strategy="no",  # the toolkit saves (hpc.hf); Hugging Face's own checkpoints stay available
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # DDP over gloo on CPU machines (accelerate wants it said)
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Progressions(args.train_size, 1),
        eval_dataset=Progressions(256, 2),
        compute_metrics=next_token_accuracy,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
    )
    trainer.train()


if __name__ == "__main__":
    main()
