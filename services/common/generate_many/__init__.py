"""``Inference.GenerateMany``, the one protocol between a router and a replica: both halves, one merge rule, one set of flow limits."""
