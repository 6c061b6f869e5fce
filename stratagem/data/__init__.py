"""Input pipelines: InputContext, options, and distributed datasets."""

from stratagem.data.from_function import DistributedDatasetsFromFunction
from stratagem.data.input import (AutoShardPolicy, DistributedDataset, InputContext, InputOptions, ValueContext,
                                  split_batch)

__all__ = ["AutoShardPolicy", "DistributedDataset", "DistributedDatasetsFromFunction", "InputContext",
           "InputOptions", "ValueContext", "split_batch"]
