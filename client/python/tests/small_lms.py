"""The small language models the sampling and sampler-snapshot tests share:
a GPT, a grouped-query decoder and that decoder with LoRA adapters, over a
vocabulary of VOCAB tokens and contexts of 24."""
import ampd

VOCAB = 23
MODELS = {
    "gpt": ampd.GPT(vocab_size=VOCAB, context_length=24, d_model=32, n_layer=2, n_head=4),
    "decoder": ampd.Decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=24),
    "lora": ampd.Decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=24, lora=ampd.LoRA(rank=4, alpha=8.0)),
}
