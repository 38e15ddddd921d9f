"""The models on a backend: decoders (decoder.py: Llama, Mistral, Qwen, Gemma, OLMo, gpt-oss and
the mixtures of experts, their specs in spec.py) and encoders, which embed and classify and
never generate (encoder.py: BERT, RoBERTa, XLM-RoBERTa, MPNet; nomic.py: NomicBERT;
modernbert.py: ModernBERT; their specs in encoder_spec.py)."""
