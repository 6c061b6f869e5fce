"""Input pipelines: InputContext, options, and distributed datasets."""

from stratagem.data.input import (AutoShardPolicy, DistributedDataset, DistributedDatasetsFromFunction,
                                  InputContext, InputOptions, ValueContext, split_batch)

__all__ = ["AutoShardPolicy", "DistributedDataset", "DistributedDatasetsFromFunction", "InputContext",
           "InputOptions", "ValueContext", "split_batch"]
