"""The parts of OPT that torchtune's building blocks do not express.

OPT (Zhang et al., 2022) is a GPT-style decoder. Most of it is made of torchtune parts (see
``_component_builders.py``); this file holds only what differs:

- learned absolute positional embeddings, indexed with OPT's offset of 2 and added to the token
  embeddings (torchtune's :class:`~torchtune.modules.TransformerDecoder` embeds tokens only);
- an optional projection between the token-embedding width and the hidden size on the way in
  and out (OPT-350m: 512 vs 1024);
- the post-LayerNorm layer of OPT-350m (LayerNorm after each residual add).
"""

from typing import List, Optional, Union

import torch
from torch import nn
from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer
from torchtune.modules.attention_utils import _MaskType


class OPTLearnedPositionalEmbedding(nn.Module):
    """Learned absolute positional embeddings with OPT's offset of 2.

    OPT's position table has ``max_seq_len + 2`` rows and position ``p`` reads row ``p + 2`` (the
    first two rows are a relic of fairseq's padding index and are never read for real tokens).
    The table is kept whole so that HF checkpoints load without slicing.

    Args:
        max_seq_len (int): number of positions the model supports.
        embed_dim (int): width of each positional embedding (the model's hidden size).
    """

    offset = 2

    def __init__(self, max_seq_len: int, embed_dim: int) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.weight = nn.Parameter(torch.empty(max_seq_len + self.offset, embed_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, input_pos: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input_pos (torch.Tensor): integer positions of any shape, each in ``[0, max_seq_len)``.

        Returns:
            torch.Tensor: embeddings of shape ``(*input_pos.shape, embed_dim)``.
        """
        return nn.functional.embedding(input_pos + self.offset, self.weight)


class OPTPostNormLayer(TransformerSelfAttentionLayer):
    """OPT-350m's post-LayerNorm self-attention layer.

    ``h = sa_norm(x + attn(x)); out = mlp_norm(h + mlp(h))``. The norms keep torchtune's names
    (``sa_norm``, ``mlp_norm``) so pre- and post-norm models share one key table.

    This subclasses :class:`~torchtune.modules.TransformerSelfAttentionLayer` and replaces only
    ``forward``: torchtune finds self-attention layers by class (``setup_caches`` to size the
    KV caches, the recipes' activation-checkpointing wrap policy), so a post-norm layer has to be
    one to get the same treatment; the caches and the constructor are inherited unchanged.
    """

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: Optional[_MaskType] = None,
        input_pos: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): input of shape ``(b, s, d)``.
            mask (Optional[_MaskType]): attention mask, as for
                :class:`~torchtune.modules.TransformerSelfAttentionLayer`. Default None (causal).
            input_pos (Optional[torch.Tensor]): token positions, passed to the attention.
            **kwargs: layer inputs not used by self-attention (encoder inputs).

        Returns:
            torch.Tensor: output of shape ``(b, s, d)``.
        """
        attn_out = self.attn(x, x, mask=mask, input_pos=input_pos)
        h = self.sa_norm(x + self.sa_scale(attn_out))
        return self.mlp_norm(h + self.mlp_scale(self.mlp(h)))


class OPTDecoder(TransformerDecoder):
    """OPT decoder: a :class:`~torchtune.modules.TransformerDecoder` with learned positions.

    Everything torchtune's recipes and generation utilities use (``setup_caches``,
    ``reset_caches``, ``caches_are_enabled``, ``set_num_output_chunks``, ``chunked_output``,
    ``output_hidden_states``, input validation) is inherited. Only the embedding step and the
    unembedding step are replaced:

    - ``h = project_in(tok_embeddings(tokens)) + pos_embeddings(input_pos)``;
    - ``logits = output(project_out(norm(h)))``, where ``output`` is usually a
      :class:`~torchtune.modules.TiedLinear` over ``tok_embeddings``.

    Positions come from ``input_pos`` when given, else ``0..s-1`` for every row. Right-padded
    batches therefore need no ``input_pos``; packed samples (whose ``input_pos`` restarts at 0 per
    sample) and left-padded prompts must pass it.

    Args:
        tok_embeddings (nn.Embedding): token embeddings, ``(vocab_size, word_embed_proj_dim)``.
        pos_embeddings (nn.Module): maps ``input_pos`` of any shape to embeddings of width
            ``embed_dim``, e.g. :class:`OPTLearnedPositionalEmbedding`.
        layers (Union[nn.Module, List[nn.Module], nn.ModuleList]): the decoder layers.
        max_seq_len (int): maximum sequence length, as for ``TransformerDecoder``.
        num_heads (int): number of attention heads (sizes the KV caches).
        head_dim (int): per-head dimension (sizes the KV caches).
        norm (Optional[nn.Module]): final LayerNorm; None for post-norm models. Default None.
        output (Union[nn.Linear, callable]): projection from ``word_embed_proj_dim`` to the
            vocabulary.
        project_in (Optional[nn.Module]): ``word_embed_proj_dim -> embed_dim`` after the token
            embedding, None when the widths are equal. Default None.
        project_out (Optional[nn.Module]): ``embed_dim -> word_embed_proj_dim`` before
            ``output``, None when the widths are equal. Default None.
        num_layers (Optional[int]): number of layers when ``layers`` is a single module.
        output_hidden_states (Optional[List[int]]): indices of layers whose inputs are returned
            along with the logits.
    """

    def __init__(
        self,
        *,
        tok_embeddings: nn.Embedding,
        pos_embeddings: nn.Module,
        layers: Union[nn.Module, List[nn.Module], nn.ModuleList],
        max_seq_len: int,
        num_heads: int,
        head_dim: int,
        norm: Optional[nn.Module] = None,
        output,
        project_in: Optional[nn.Module] = None,
        project_out: Optional[nn.Module] = None,
        num_layers: Optional[int] = None,
        output_hidden_states: Optional[List[int]] = None,
    ) -> None:
        super().__init__(
            tok_embeddings=tok_embeddings,
            layers=layers,
            max_seq_len=max_seq_len,
            num_heads=num_heads,
            head_dim=head_dim,
            norm=norm if norm is not None else nn.Identity(),
            output=output,
            num_layers=num_layers,
            output_hidden_states=output_hidden_states,
        )
        self.pos_embeddings = pos_embeddings
        self.project_in = project_in
        self.project_out = project_out

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: Optional[_MaskType] = None,
        encoder_input: Optional[torch.Tensor] = None,
        encoder_mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, List[torch.Tensor]]:
        """
        Args:
            tokens (torch.Tensor): token ids of shape ``(b, s)``.
            mask (Optional[_MaskType]): boolean ``(b, s, s)`` mask (``(b, s, cache_len)`` with
                KV caches; True = attend) or a flex-attention ``BlockMask``. Default None (causal).
            encoder_input (Optional[torch.Tensor]): passed to the layers (unused by OPT).
            encoder_mask (Optional[torch.Tensor]): passed to the layers (unused by OPT).
            input_pos (Optional[torch.Tensor]): positions of the tokens, shape ``(b, s)``, ``(s,)``,
                or ``(b,)``/a scalar for one token per row (as torchtune's ``generate`` passes
                them); required with KV caches. Default None: ``0..s-1``.

        Returns:
            Union[torch.Tensor, List[torch.Tensor]]: fp32 logits ``(b, s, vocab_size)``; a list of
            ``num_output_chunks`` chunks of them when chunking is on; with
            ``output_hidden_states``, the requested hidden states followed by the logits.
        """
        seq_len = tokens.shape[1]
        self._validate_inputs(
            seq_len,
            mask=mask,
            encoder_input=encoder_input,
            encoder_mask=encoder_mask,
            input_pos=input_pos,
        )
        if input_pos is None:
            input_pos = torch.arange(seq_len, device=tokens.device)

        h = self.tok_embeddings(tokens)  # (b, s, word_embed_proj_dim)
        if self.project_in is not None:
            h = self.project_in(h)  # (b, s, d)
        # (b or 1, s, d): input_pos may be (b, s), (s,), (b,) with s == 1, or a scalar
        pos = self.pos_embeddings(input_pos).reshape(-1, seq_len, h.shape[-1])
        h = h + pos.to(h.dtype)

        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.output_hidden_states:
                hidden.append(h)
            h = layer(
                h,
                mask=mask,
                encoder_input=encoder_input,
                encoder_mask=encoder_mask,
                input_pos=input_pos,
            )

        output = self.unembed(h)
        return output if not hidden else [*hidden, output]

    def unembed(self, h: torch.Tensor) -> Union[torch.Tensor, List[torch.Tensor]]:
        """Final norm, ``project_out``, then the (optionally chunked) output projection.

        Args:
            h (torch.Tensor): last hidden state, ``(b, s, d)``.

        Returns:
            Union[torch.Tensor, List[torch.Tensor]]: fp32 logits ``(b, s, vocab_size)``, or
            ``num_output_chunks`` chunks of ``(b, s / num_output_chunks, vocab_size)`` in the
            model's dtype (:class:`~torchtune.modules.loss.CEWithChunkedOutputLoss` upcasts).
        """
        h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)  # (b, s, word_embed_proj_dim)
        if self.num_output_chunks > 0:
            return self.chunked_output(h)
        return self.output(h).float()
