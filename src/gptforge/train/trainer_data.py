"""The Trainer's data side: tokenizer, datasets, and endless batch iterators over them."""

from __future__ import annotations

import torch

from gptforge.errors import ConfigError


class TrainerData:
    """Mixin of `Trainer`: loads the tokenizer and datasets and yields device batches."""

    def _load_tokenizer(self):
        from gptforge.data.tokenizer import load_tokenizer

        return load_tokenizer(self.cfg.Data.tokenizer, self.resume_dir)

    def _build_datasets(self) -> dict:
        if self.datasets is None:
            from gptforge.data.dataset import build_datasets

            splits = ("Train", "Eval") if self._eval_enabled() else ("Train",)
            self.datasets = build_datasets(self.cfg, splits, tokenizer=self.tokenizer)
        if "Train" not in self.datasets or self.datasets["Train"] is None:
            raise ConfigError("no Train dataset: set Data.Train.dataset.input_dir")
        return self.datasets

    def _eval_enabled(self) -> bool:
        e = self.cfg.Engine
        return e.eval_freq > 0 and e.eval_iters > 0

    def _loader(self, split: str, consumed: int):
        from gptforge.data.dataset import GPTBatchSampler, collate

        ds = self.datasets[split]
        sp = getattr(self.cfg.Data, split)
        sampler = GPTBatchSampler(len(ds), self.local_bs, self.par.data_rank, self.par.data_world_size,
                                  consumed_samples=consumed, drop_last=sp.sampler.drop_last)
        workers = max(0, sp.loader.num_workers)
        # A private generator: creating a loader iterator must not draw from the global RNG
        # (that would shift dropout masks and break bit-exact resume).
        return torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                                           pin_memory=self.device.type == "cuda", generator=torch.Generator(),
                                           persistent_workers=False)

    def _batches(self, split: str, consumed: int):
        """Endless batches: a finished pass starts the next one (indices wrap like the sampler's)."""
        while True:
            n = 0
            for batch in self._loader(split, consumed):
                n += 1
                yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            if n == 0:
                from gptforge.errors import DataError

                raise DataError(f"Data.{split}: the dataset yields no batch of {self.local_bs} samples")
            consumed = 0
