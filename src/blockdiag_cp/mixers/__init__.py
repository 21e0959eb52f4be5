"""Token mixers other than softmax attention: which ones a model has, and the refusal.

blockdiag-cp keeps documents apart inside the attention interface. A layer that mixes
tokens without calling it (a Gated DeltaNet or Mamba recurrence, a short causal
convolution, an RWKV-style scan, a sparse-attention indexer) would carry its state and
its convolution window across document boundaries on a packed row, and under CP would
run on the local shard alone, starting from an empty state on every rank. Such layers
are either routed per document (`prepare_model`, routing.py; the kernels: conv.py) or
refused, naming them (`refuse_unrouted_mixers`, detect.py).

    verify.py      every token mixer of a model verified to go through the library, or the model refused
    detect.py      which mixers a model has outside the attention interface, and the refusal
    routing.py     prepare_model: per-document forwards for the supported mixer layers, then verify
    temperature.py Llama 4's query temperature at each token's position in its document
    marks.py       the attributes prepare_model sets on a model's modules
    conv.py        the per-document causal convolution across CP ranks (a k - 1 row halo)
    recurrence.py  the gated delta rule and Mamba2's scan per document across CP ranks (state hand-off)
    chunked.py     the library's own chunked kernels for both (torch, any device, any initial state)
    traffic.py     bytes per mixer layer (StepState.mixer_bytes_per_layer) beside head parallelism
"""

from .detect import UnroutedMixer, find_unrouted_mixers, refuse_unrouted_mixers, unrouted_config_mixers
from .routing import prepare_model
from .verify import ModelCheck, check_model, verify_model
from .traffic import MixerBytes, MixerShape

__all__ = ("MixerBytes", "MixerShape", "ModelCheck", "UnroutedMixer", "check_model", "find_unrouted_mixers", "prepare_model",
           "refuse_unrouted_mixers", "unrouted_config_mixers", "verify_model")
