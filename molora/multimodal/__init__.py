"""Early-fusion text+image on molora: one vocabulary for words and image codes, vocabulary routing.

    molora.multimodal.vocab      the 46-token tokenizer, sklearn digits quantised to 16 levels, sequences
    molora.multimodal.base       the tiny Llama-architecture base and its training
    molora.multimodal.generate   constrained generation (64-code image spans), captioning, PNGs
    molora.multimodal.recipe     the digits bundle: base + image/text adapters + a vocab router from the
                                 tokenizer; shipped in molora/multimodal/bundle, rebuilt by
                                 `molora build-multimodal`; its manifest declares the image spans
                                 that the engine constrains (molora.sampling.SpanConstraint)

Nothing here is imported by molora's core; scikit-learn (the digits) is the optional extra `multimodal`.
"""
