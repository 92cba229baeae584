"""The measurement tools: the KLD acceptance rule (``fle-accept``), paired
speed brackets against OpenAI-compatible servers (``fle-bracket``), the
knowledge probe (``fle-probe``) and the plots (``fle-plot``), with the
statistics they share (:mod:`fle_quant.measure.stats`). Torch-free; talks to
servers over HTTP only."""
