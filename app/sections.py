"""The walkthrough: every section of the explainer in order, with its prose and widgets.

The page renders SECTIONS top to bottom, and each /embed/<name> page finds its own section with
by_widget. Prose is plain text; the only markup is a link to another section, written [words](#slug).
"""
from dataclasses import dataclass
from types import SimpleNamespace

BADGES = {  # source badge key -> (label, what it means)
    "live": ("live model", "computed just now by the model running in this server's engine (named at the top of the page)"),
    "measured": ("measured here", "timed on this server, just now"),
    "computed": ("computed", "a formula over stated inputs; the formula is shown"),
    "simulated": ("simulated", "a model of hardware we do not have; the assumptions are shown"),
}


@dataclass(frozen=True)
class Section:
    number: int
    slug: str                    # the anchor, e.g. "kv-cache"
    title: str                   # the section title from OUTLINE.md
    widgets: tuple[str, ...]     # embed names from OUTLINE.md (empty for section 23)
    badges: tuple[str, ...]      # keys of BADGES its figures use
    summary: str                 # one sentence: what the reader will see in the widget
    prose: tuple[str, ...]       # paragraphs


SECTIONS: tuple[Section, ...] = (
    Section(1, "chat", "What happens when you press Send", ("chat",), ("live", "measured"),
            "A real chat with {model_label}: your messages as its chat template serializes them, the "
            "token count against the {context_window:,}-token window, the answer streaming with its TTFT and TPOT, why it "
            "stopped, and a timeline of the request from the engine's own timestamps.",
            ("Pressing Send does not send only your new message. The app takes the whole conversation so far, "
             "wraps each message in markers that say who is speaking, and joins it all into one text. This "
             "recipe is the model's chat template. SmolLM2's template marks each turn with special tokens such as "
             "<|im_start|> and <|im_end|>, and adds a default system message if you gave none. The model is then "
             "asked to continue that text.",
             "The model reads text as tokens: small pieces, often a word or part of one, each with a number (the "
             "[tokens](#tokenizer) section shows them). Prompt and answer together must fit in the context "
             "window, the most tokens the model can take into account at once: {context_window:,} for {model_label} on this server. The "
             "counter beside the chat shows how much of it this conversation already uses.",
             "The answer arrives one token at a time. Two numbers describe the wait: time to first token (TTFT), "
             "from Send until the first piece appears, and time per output token (TPOT), the average gap between "
             "the pieces after that. Generation ends when the model emits its end-of-turn token, when a length "
             "limit is reached, when a stop string appears, or when you abort.",
             "Send a follow-up and the entire transcript goes through the model again: it keeps no memory "
             "between requests. What saves the repeated work is the [prefix cache](#prefix-cache), which "
             "recognizes the part of the transcript already processed; the widget shows how many tokens came "
             "from it. The timeline marks when the request waited, when its prompt was processed, and each step "
             "that produced a token.")),
    Section(2, "tokenizer", "Tokens", ("tokenizer",), ("live",),
            "Type any text and see the real subword pieces the model's tokenizer cuts it into, with their IDs, "
            "whitespace made visible, special tokens marked, and the count of words against tokens.",
            ("A language model never sees letters or words. A tokenizer first cuts the text into tokens, pieces "
             "taken from a fixed vocabulary, and replaces each by its ID, a whole number. SmolLM2's vocabulary "
             "has {vocab_size:,} pieces, learned from its training text: frequent words get a piece of their own, while "
             "rare words, names and long numbers are built from several smaller pieces.",
             "Whitespace belongs to the pieces. A word that follows a space usually becomes one token that "
             "includes the space, so the word cat after a space and cat at the very start of the text are two "
             "different tokens with different IDs. The widget draws spaces and line breaks as visible marks, so "
             "you can see which token took them.",
             "The pieces are made of bytes, not letters. Text is first written as UTF-8 bytes, and a letter "
             "outside the basic Latin alphabet takes two to four of them, so an emoji or a rare character can be "
             "cut into pieces that each hold only part of it. The widget shows such a piece as its bytes, beside "
             "the character it completes.",
             "Special tokens mark structure, such as the start and end of a chat turn or the end of a text, and "
             "the chat template puts them in. They are written like text, <|im_start|> for instance, and this "
             "tokenizer turns that string into the special token wherever it appears, even typed inside a message. "
             "Everything that follows is counted in tokens, not words: the context window, the time to answer, the "
             "price of a hosted model. That is why the widget shows both counts.")),
    Section(3, "embedding", "Embeddings", ("embedding",), ("live",),
            "Pick a token and see its real row of the model's embedding table drawn as a strip of {hidden_size} values, with "
            "the tokens whose rows point in the most similar directions.",
            ("The model's first step is a lookup. Its embedding table has one row for every piece of the "
             "vocabulary: {vocab_size:,} rows of {hidden_size} numbers each. A token's ID simply selects its row; nothing is "
             "multiplied. That row becomes the token's starting vector, the list of {hidden_size} numbers that the rest of "
             "the model reads and refines.",
             "The numbers were set during training, so tokens used in similar ways end up with rows that point "
             "in similar directions. Cosine similarity measures this: the cosine of the angle between two rows, "
             "1 when they point the same way and near 0 when they are unrelated. A token's nearest neighbours "
             "are often the same word with other capitals or spacing, or words of the same kind.",
             "SmolLM2 uses the same table again at the very end. A token's final vector is compared with every "
             "row, and the resulting {vocab_size:,} scores, called logits, say how strongly the model favours each token "
             "as the next one. Sharing one table this way, known as tied embeddings, saves {embedding_params_m:.1f} million "
             "parameters, {embedding_share} of this model.")),
    Section(4, "positions", "Positions", ("positions",), ("live", "computed"),
            "Real query and key vectors rotated by RoPE: the dimension pairs turning at several speeds for the "
            "same token at position 5 and at position 500, and a check that the attention score depends only on "
            "how far apart two tokens are.",
            ("[Attention](#attention), where tokens look at each other, works by comparing vectors. On its own "
             "that comparison carries no sense of order: it cannot tell whether a word came third or "
             "three-hundredth. Position has to be written into the vectors, and SmolLM2 does it with rotary "
             "position embedding, RoPE.",
             "RoPE treats the {head_dim} numbers of each query and key as {rope_pairs} pairs, like {rope_pairs} clock hands, and turns each "
             "pair by an angle proportional to the token's position. The first pair turns one radian per "
             "position; each later pair turns more slowly, down to the last, which needs several hundred "
             "thousand positions to go round once. The base that sets this slowdown, theta, is {rope_theta:,.0f} in "
             "{model_label}.",
             "When a query and a key are both turned, their dot product (the sum of the products of matching "
             "numbers) depends only on the difference between their angles, so on the distance between the two "
             "tokens, not on where they sit. The widget tests this on the model's real vectors: a query and a "
             "key placed the same distance apart give the same score near the start of a text and thousands of "
             "tokens later, up to rounding.")),
    Section(5, "block", "The transformer block", ("block",), ("live",),
            "{model_label}'s {num_layers} blocks as a stack, with live per-layer figures for your prompt (size of the residual "
            "stream, spread of attention, size of each MLP update) and its grouped-query attention drawn as {num_heads} "
            "query heads sharing {num_kv_heads} key-value heads.",
            ("After the lookup, each token's vector passes through {num_layers} blocks that share one design but have "
             "their own learned weights. The vector flowing through them is called the residual stream: {hidden_size} "
             "numbers per token. A block does not replace it; it computes a correction and adds it on. After the "
             "last block, a final normalization and the embedding table turn the stream into logits.",
             "Each block has two parts. Attention lets a token gather information from the tokens before it. The "
             "MLP, a small feed-forward network, then works on each token alone: it widens the {hidden_size} numbers to "
             "{intermediate_size:,} through a gated layer called SwiGLU and narrows them back. Before each part, RMSNorm "
             "rescales the vector to a steady size, so no part is swamped by large values.",
             "{model_label} uses grouped-query attention: {num_heads} query heads but only {num_kv_heads} key-value heads, each shared by "
             "{group} query heads. Queries are used once and dropped, while keys and values are stored for every "
             "past token, so sharing them cuts that stored memory to 1/{group} of what {num_heads} full heads would need "
             "(see [KV memory](#kv-memory)).",
             "The live figures come from running your prompt through the model. For each layer they show how "
             "large the residual stream has grown, how spread out attention is (its entropy: high when a head "
             "looks at many tokens, low when it fixes on one), and how big the MLP's correction is.")),
    Section(6, "attention", "Attention", ("attention",), ("live", "computed"),
            "Real attention weights of {model_label} for your text in any layer and head: click a token to see how its "
            "attention is divided among the tokens before it, with the causal mask visible and all {num_heads} heads of a "
            "layer side by side.",
            ("In every head, each token derives three vectors of {head_dim} numbers from its residual stream: a query, "
             "what it is looking for; a key, what it offers; and a value, what it passes on. Its query is "
             "compared with the key of every visible token by a dot product. Softmax turns those scores into "
             "weights that are positive and add up to one, and the head's output is the weighted mix of the "
             "values.",
             "The causal mask lets a token see only itself and the tokens before it, never those after, which is "
             "why the grid of weights is a triangle. It also means that once a token's keys and values are "
             "computed, later tokens never change them. The [KV cache](#kv-cache) is built on that fact.",
             "Heads specialize. You will usually find heads that look mostly at the previous token, heads that "
             "park most of their weight on the first token when nothing else is relevant, and heads that pick "
             "out an earlier word related to the current one. The small multiples show all {num_heads} heads of a layer; "
             "each group of {group} reads the same keys and values but asks different questions.")),
    Section(7, "generation", "Prefill once, decode one token at a time", ("generation",), ("live", "measured"),
            "Step through a real generation: one prefill pass, then a decode step per click, with the most "
            "likely next tokens and their probabilities from the real logits, reshaped live by temperature, "
            "top-k and top-p, and the KV cache growing by one token each step.",
            ("Generation is a loop. First the whole prompt goes through the model in one pass, called prefill, "
             "which yields logits for the token that should come next. Softmax turns those {vocab_size:,} scores into "
             "probabilities, one token is chosen and appended, and the model runs again on that single new "
             "token. Each such pass is a decode step, and the loop ends at an end token or a length limit.",
             "How the token is chosen is up to the caller. Greedy decoding always takes the most likely one. "
             "Sampling draws at random in proportion to the probabilities. Temperature divides the logits first: "
             "below 1 it sharpens the distribution, above 1 it flattens it. Top-k keeps only the k most likely "
             "tokens, and top-p the smallest set whose probabilities add up to p. Move them and watch the bars "
             "change.",
             "Sampling is random but repeatable: each request in sendlens draws from its own random generator, "
             "so a given seed gives the same tokens whether the request runs alone or beside others. Meanwhile "
             "the KV cache, the stored keys and values of earlier tokens, grows by one token per step; [the KV "
             "cache](#kv-cache) section shows why it exists.")),
    Section(8, "phases", "Two phases", ("phases",), ("measured",),
            "Timings from this server: prefill time against prompt length, the time of every decode step of a "
            "generation, and TTFT, TPOT and end-to-end latency defined beside live numbers.",
            ("Prefill and decode do the same arithmetic per token, yet they load the machine very differently. "
             "Prefill pushes all the prompt's tokens through each weight matrix together, so every weight read "
             "from memory is used many times and the arithmetic units stay busy. Decode pushes one token per "
             "request, so the weights are read in full for a small amount of work, and memory speed sets the "
             "pace.",
             "Three measures of latency follow. TTFT, time to first token, runs from the request's arrival to "
             "its first generated token: queueing plus prefill, so it grows with the prompt. TPOT, time per "
             "output token, is the mean gap between the tokens after that, set by the decode step. End-to-end "
             "latency covers the whole request: about TTFT plus one TPOT for each further token.",
             "The widget times the engine on this server, so its numbers depend on the machine and on what else "
             "it is doing. The shape is what carries over: prefill time rises with prompt length, while decode "
             "steps stay nearly flat, growing only slowly as each step reads a longer cache. The [benchmark "
             "page](/benchmark) has the same two phases measured for this engine against Hugging Face "
             "transformers and llama.cpp, on the project's own machine.")),
    Section(9, "kv-cache", "The KV cache", ("kv-cache",), ("measured", "computed"),
            "Generating N tokens with and without the KV cache, timed on this server: without it each step "
            "recomputes the whole sequence, a growing triangle of work; with it each step computes one token; "
            "the work is counted on both sides.",
            ("Each decode step needs the keys and values of every earlier token, in every layer. Without a cache "
             "the model would compute them all again at each step: step n processes n tokens to produce one, and "
             "the total work grows like a triangle, roughly with the square of the length.",
             "The KV cache keeps those keys and values in memory once computed. A decode step then runs only the "
             "new token through the model: its query is compared with the stored keys, and its own key and value "
             "are appended for the steps that follow. The work through the weight matrices stays flat per step; "
             "only the reading of the cache grows with the length.",
             "Both ways compute the same attention; the cache only skips repeated work, and the widget counts "
             "the tokens processed each way beside the measured times. The price is memory, held for as long as "
             "the request lives. [KV memory](#kv-memory) shows how much, and [paged KV](#paging) how an engine "
             "hands it out.")),
    Section(10, "kv-memory", "KV memory", ("kv-memory",), ("computed", "live"),
            "A calculator of KV cache size from layers, KV heads, head size, number format, context and batch, "
            "with presets from SmolLM2-135M to DeepSeek-V3, and the SmolLM2 figure checked against the live "
            "engine's own KV pool.",
            ("The size of the cache follows from the model's shape. Per token it holds 2 (a key and a value) x "
             "layers x KV heads x head size numbers. For {model_label} that is 2 x {num_layers} x {num_kv_heads} x {head_dim} = {kv_values_per_token:,} numbers, "
             "or {kv_bytes_per_token:,} bytes as this server's engine stores them. A full {context_window:,}-token "
             "context takes about {kv_context_mb:,.0f} MB, against about {weights_mb:,.0f} MB for the weights themselves.",
             "Every running request needs a cache of its own, while the weights are shared by all. So on a "
             "serving machine it is often KV memory, not the weights, that limits how many conversations run "
             "together, and models are designed to shrink it. Fewer bytes per number help, and so does sharing "
             "key-value heads, as {model_label}'s {num_kv_heads} do for its {num_heads} query heads.",
             "DeepSeek-V3 goes further with multi-head latent attention (MLA): per layer and token it stores a "
             "512-number compressed latent and a 64-number key for position, 576 in all, and rebuilds every "
             "head's keys and values from them. The presets let you compare models; the SmolLM2 line is checked "
             "against the bytes the live engine actually set aside for its pool.")),
    Section(11, "paging", "Paged KV", ("paging",), ("live", "computed"),
            "The live engine's block tables: which {block_size}-token blocks of the KV pool each running request holds, "
            "which are free, which are shared by a common prefix and by how many requests, and what reserving "
            "one contiguous stretch per request would waste for the same requests.",
            ("When a request starts, nobody knows how long its answer will be. Reserving one contiguous stretch "
             "of memory for the longest possible answer wastes most of it: a short reply sits on room for "
             "thousands of tokens it never writes, and fewer requests fit at once.",
             "sendlens does what vLLM's PagedAttention does. The KV pool is cut into blocks of {block_size} token slots, "
             "and each request keeps a block table: the list of physical blocks that hold its tokens, in order. "
             "A new block is taken only when the last one is full, so at most {block_size_minus_one} slots per request lie empty, "
             "and the blocks need not sit side by side, much like pages of memory in an operating system.",
             "Blocks can be shared. Requests that begin with the same tokens point at the same physical blocks, "
             "and a reference count records how many requests use each one; a block returns to the free list "
             "only when its count reaches zero. If the pool runs dry, the newest request is preempted: its "
             "blocks are released, and its tokens are computed again when it resumes.")),
    Section(12, "gemm", "Batching turns a trickle into a matrix", ("gemm",), ("measured", "computed"),
            "Matrix multiplications at SmolLM2's own layer shapes timed on this server for 1 to 256 rows, the "
            "throughput that rises as rows are added, and a roofline drawn from this server's measured memory "
            "bandwidth and peak arithmetic rate.",
            ("Most of a model's work is multiplying token vectors by weight matrices. One token is a single row: "
             "the processor must read the whole matrix from memory to do one multiply and one add per weight. "
             "That ratio of arithmetic to memory traffic, the arithmetic intensity, is so low that the processor "
             "spends most of its time waiting for data.",
             "Stack the tokens of many requests into one matrix and each weight, read once, serves every row. Up "
             "to a point, adding rows barely changes the time, so throughput rises almost in proportion. Past "
             "that point the arithmetic units are the limit and the time grows with the rows. The widget "
             "measures this at SmolLM2's own shapes, such as the 576 by 1,536 projection into its MLP.",
             "A roofline explains the curve: the attainable speed is the lesser of the peak arithmetic rate "
             "(FLOP/s, floating-point operations per second) and the memory bandwidth times the arithmetic "
             "intensity. Where the two limits meet depends on the hardware; GPUs, whose arithmetic far outpaces "
             "their memory, usually need many more rows to get there than a CPU does. The [benchmark "
             "page](/benchmark) shows how close this engine's decode comes to its bandwidth limit, and its "
             "speed at 8, 32 and 64 requests at once.")),
    Section(13, "throughput-latency", "Throughput against latency", ("throughput-latency",), ("measured",),
            "The real engine under generated load at several arrival rates and batch limits, each run plotted as "
            "throughput against the median and 99th-percentile TTFT and TPOT.",
            ("Throughput is how many tokens the server produces per second across all requests; latency is how "
             "long one person waits. Batching raises throughput, but each step then does more work, so every "
             "user's tokens come a little slower. And when requests arrive faster than they can be served, they "
             "queue, and time to first token climbs.",
             "The widget sends the real engine streams of generated requests at several arrival rates and with "
             "several batch limits, the most requests allowed to run together. For each run it records the p50 "
             "and p99 of TTFT and TPOT. The p50, the median, is what a typical request sees; the p99 is the "
             "slowest request in a hundred, the tail that users remember.",
             "Expect a familiar shape. At low rates batches are small, latency is good, and throughput is "
             "limited by how few requests arrive. As the rate grows, throughput rises until the engine is "
             "saturated; beyond that it stays flat while the queue, and with it TTFT, keeps growing. A higher "
             "batch limit buys more throughput with slower tokens.")),
    Section(14, "batching", "Static against continuous batching", ("batching",), ("live", "measured"),
            "One workload run through the real scheduler twice, static and continuous: the per-step trace as a "
            "grid of batch slots (P prefill, Dn the n-th token, · an idle slot) and the completion time of each "
            "request side by side.",
            ("Static batching, the older way, collects a batch of requests and runs it until every member has "
             "finished. Answers differ in length, so slots whose answer is done sit idle while the longest one "
             "goes on, and a request that arrives meanwhile waits for the whole batch.",
             "Continuous batching re-forms the batch at every step. A finished request leaves at once, and a "
             "waiting one takes its slot on the next step, its prompt processed in the same pass as the other "
             "requests' decode tokens. Nothing is padded to a common length: the tokens of all sequences are "
             "packed end to end, and only attention keeps them apart.",
             "The widget runs the same workload through both modes of sendlens' scheduler and draws the real "
             "trace, step by step and slot by slot. Because every matrix multiplication in the engine gives a "
             "row the same result whatever else is in the batch, each greedy or seeded request produces the same "
             "tokens in both modes; only when they finish differs.")),
    Section(15, "chunked-prefill", "Chunked prefill", ("chunked-prefill",), ("measured",),
            "A long prompt arrives while other requests are decoding: the measured gaps between the decoders' "
            "tokens with the prompt processed in one piece and in chunks.",
            ("Processing a long prompt takes far longer than one decode step. If the engine runs the whole "
             "prompt in a single step, every request that was decoding waits for it, and their readers see the "
             "text pause mid-sentence.",
             "With chunked prefill each step has a token budget, 512 tokens by default in sendlens. Requests "
             "that were already running go first, each with its one decode token, and what remains of the budget "
             "goes to the next chunk of the newly arrived prompt. The prompt is finished over several steps, and "
             "the decoders keep their rhythm.",
             "The cost moves rather than disappears: the long prompt's own TTFT grows a little, since it now "
             "spans several steps, while the decoders' inter-token latency, the gap between one token and the "
             "next, stays short. The widget measures those gaps with chunking on and off.")),
    Section(16, "prefix-cache", "Prefix caching", ("prefix-cache",), ("live", "measured"),
            "The same question asked twice, and several users' questions after one system prompt: how many prompt "
            "tokens each takes from the prefix cache, which blocks matched, and the time to first token with and "
            "without the cache, measured on this server.",
            ("Many requests begin alike: the same system prompt, the same document, the earlier turns of the "
             "same chat. A shared beginning produces the same keys and values every time, so computing them "
             "again for each request is wasted work.",
             "sendlens names each full block of {block_size} tokens by a chained hash, computed from the block's tokens "
             "and the hash of the block before it. Equal names therefore mean that the whole text up to that "
             "block is equal, not just those 16 tokens. A new request looks up its blocks in order, takes every "
             "match, and stops at the first miss.",
             "Some details matter. Only full blocks are shared, and the last prompt token is always computed "
             "afresh, because its logits pick the first new token. A block whose last user has finished keeps "
             "its contents until the pool needs room and evicts the least recently used. This is what makes the "
             "follow-up turns in [the chat](#chat) cheap.",
             "The widget measures on two engines of its own that share the live model's weights, one with the "
             "cache and one without, both starting empty. The serving engine's cache holds whatever other readers "
             "sent, so a measurement there would neither start from nothing nor leave their timings alone.")),
    Section(17, "tensor-parallel", "Tensor parallelism", ("tensor-parallel",), ("live", "measured"),
            "{model_label}'s blocks split across real worker processes with torch.distributed: who holds which "
            "slices of the matrices, the all-reduce that sums their partial results, the output compared with a "
            "single process, and the measured time of computing against communicating.",
            ("When a model is too large or too slow for one device, one remedy is to split each layer's matrices "
             "across several. Attention divides by heads: each worker takes some query heads and the key-value "
             "heads they read. The MLP divides along its {intermediate_size:,}-wide middle, each worker taking a "
             "slice of columns. Every worker then holds and reads only its share of those weights; the embedding "
             "table and the norms are copied to every worker.",
             "Each worker ends its attention with its part of the output projection, and its MLP with its part "
             "of the down projection, so it holds only a partial sum of the {hidden_size} numbers of each token. "
             "An all-reduce adds the parts up and leaves every worker with the total. That is two per block, "
             "after attention and after the MLP, so {allreduces_per_pass} per forward pass, each a round of "
             "messages between the workers. This layout is Megatron-LM's.",
             "Grouped-query attention limits the split. The {num_heads} query heads read {num_kv_heads} key-value "
             "heads in groups of {group}, and a query head must sit on the same worker as the key-value head it "
             "reads. So the degree, the number of workers, must divide the {num_kv_heads} key-value heads, which "
             "gives each worker whole groups. Larger setups with more workers than key-value heads copy each "
             "key-value head onto several workers instead. Of degrees 1 to 4, that leaves "
             "{tp_degrees}; {tp_refused_note}.",
             "The widget runs the split with real processes on this server's CPU, one thread each, and checks "
             "the logits and the greedy tokens against a single process. The logits agree to within 0.0001, not "
             "exactly, because the all-reduce adds the partial sums in another order. It also times "
             "arithmetic against communication. {model_label} is small and this machine has few cores, so the "
             "exchanges dominate: with more processes than cores, every all-reduce also waits for a worker that "
             "is not running. Splitting pays when the slices are large and the links between devices are fast.")),
    Section(18, "pipeline", "Pipeline parallelism", ("pipeline",), ("live", "measured", "computed"),
            "{model_label}'s layers split into stages in real processes with microbatches flowing through: the "
            "measured timeline of warm-up, steady state and drain, and the idle fraction, the bubble, against "
            "the number of microbatches.",
            ("Pipeline parallelism splits the model by depth instead: one worker holds the first blocks, the "
             "next worker the following ones, and so on. Only the residual stream crosses from one stage to the "
             "next, far less traffic than the exchanges inside every block that [tensor "
             "parallelism](#tensor-parallel) needs.",
             "A single input would keep only one stage busy at a time. So the batch is cut into microbatches: "
             "while the second stage works on the first microbatch, the first stage starts on the second. The "
             "timeline shows a warm-up as the stages fill, a steady state with all of them busy, and a drain as "
             "they empty.",
             "The idle time of warm-up and drain is the pipeline bubble. With p stages and m microbatches of "
             "equal cost, it is (p - 1) / (m + p - 1) of the total time. More microbatches shrink it, but each "
             "one must stay large enough to use the hardware well. The widget plots the measured bubble next to "
             "this formula.",
             "The stages are real processes on this server, one thread each, timed on one clock that every "
             "process on the machine shares. Their output is the single process's, bit for bit: each stage runs "
             "the same blocks on the same numbers, and a send copies them exactly. The timings are less tidy. "
             "Stages differ by a layer, sends cost time, and when more stages are busy than the machine has "
             "cores, they take turns, which stretches the steady state. So the measured points sit off the "
             "curve, and the timeline shows where the time went.")),
    Section(19, "moe", "Mixture of experts", ("moe",), ("live", "computed", "measured"),
            "A variant of SmolLM2 with each MLP cut into 16 experts and a trained router choosing 2 per token: "
            "the routing of the first 12 tokens of your batch, the load on each expert over the whole batch, "
            "per-expert batch size as the batch grows, what dropping experts costs in perplexity, and one "
            "layer's experts spread over worker processes.",
            ("A mixture-of-experts (MoE) model replaces the single MLP of each block with many smaller ones, "
             "called experts, and adds a router that picks a few of them for each token. A token runs only "
             "through its chosen experts, so the arithmetic per token follows the active parameters, while "
             "memory must hold all of them.",
             "The widget uses a variant of SmolLM2 made for this page, not trained as an MoE. An MLP is a sum "
             "of what each of its {intermediate_size:,} hidden units adds, so cutting the units into 16 groups of "
             "{moe_expert_units} gives 16 experts whose sum is exactly the original MLP; this is called "
             "MoEfication. Units that fire on the same tokens were grouped together, and a small router per "
             "layer was trained to pick the 2 experts that add the most to each token. You see the choices for "
             "the first 12 tokens of your batch and how many tokens each expert received over all of it.",
             "Two experts of 16 skip seven eighths of the MLP's arithmetic, and a model carved out of a dense "
             "one pays for that in quality: the perplexity table, computed on held-out text, climbs as experts "
             "are dropped and comes back to the dense model's with all 16. Models trained as an MoE from the "
             "start, such as Mixtral or DeepSeek-V3, learn experts that each carry a token on their own.",
             "Routing splits the batch. With 2 of 16 experts per token, a batch of B tokens gives each expert "
             "B/8 tokens on average; DeepSeek-V3 picks 8 of its 256 routed experts, so each gets only B/32. "
             "Small per-expert batches bring back the thin matrices that [batching](#gemm) is meant to avoid, so "
             "an MoE needs large batches to pay off, and an uneven load makes every step wait for the busiest "
             "expert.",
             "Large MoE models spread their experts over many devices, which is called expert parallelism: each "
             "token is sent to the device holding its expert, and the result is sent back, in two all-to-all "
             "exchanges per layer. The widget does this across real processes, checks that the output is the "
             "one a single process computes, and measures the exchange.")),
    Section(20, "efficiency", "Efficiency tricks", ("quantization", "speculative"), ("live", "measured"),
            "Quantization of SmolLM2's weights to bf16, int8 and int4 with measured memory, speed and shifts in "
            "the top candidates, and speculative decoding with a draft's accepted and rejected tokens, the "
            "acceptance rate and the measured speed-up.",
            ("Quantization stores the weights with fewer bits: 16 in bf16 instead of 32 in fp32, or 8 or 4 as "
             "integers with scale factors that map them back to real values. Less memory to read can make decode "
             "steps faster, when the hardware has good kernels for the format. The price is rounding error, "
             "which can reorder the model's top candidates. The widget measures memory and speed and shows the "
             "candidates move.",
             "Speculative decoding lets the model check several tokens in one pass. A cheap draft guesses the "
             "next few tokens; the model runs once over all of them, like a short prefill, keeps the guesses up "
             "to the first one it would not have chosen, and adds one token of its own. With greedy decoding the "
             "output is exactly what plain decoding gives; only the speed changes, with the acceptance rate.",
             "Other tricks appear elsewhere on the page: [continuous batching](#batching), [paged KV](#paging), "
             "[chunked prefill](#chunked-prefill), [prefix caching](#prefix-cache), and a smaller cache through "
             "shared heads ([the block](#block)) or MLA ([KV memory](#kv-memory)). Fused kernels and efficient "
             "attention such as FlashAttention compute the same result with fewer trips to memory, the limit "
             "measured in [batching](#gemm).",
             "Communication between devices can be overlapped with computation, so that it costs less waiting. "
             "The [tensor parallelism](#tensor-parallel) and [pipeline](#pipeline) sections measure how much "
             "time there is to hide, and a well-built engine hides as much of it as it can behind arithmetic.")),
    Section(21, "slo", "Optimize the metric you care about", ("slo",), ("measured",),
            "The real engine under load with an admission limit and a batch limit: throughput side by side with "
            "goodput, the requests per second that meet a latency objective.",
            ("A service-level objective, or SLO, is a promise about latency: for instance, that 99 requests in "
             "100 see their first token within a set time and their later tokens at a set pace. Goodput counts, "
             "per second, only the requests that kept the promise. A request served late still cost the machine "
             "its work but counts for nothing.",
             "Throughput and goodput part ways under load. Admit every request and the batch swells, steps slow, "
             "queues form, and many requests miss the objective just as the machine is busiest. Admission "
             "control, turning away or holding back requests beyond a limit, and a cap on the batch size can "
             "raise goodput while lowering raw throughput.",
             "The widget runs the real engine at a load you choose, with the limits you set, and shows "
             "throughput and goodput together. Which setting is best depends on the metric: a chat product lives "
             "by TTFT and TPOT, while an overnight job that summarizes a million documents cares only about "
             "tokens per second for its money.")),
    Section(22, "economics", "Why a giant MoE is cheap at scale and dear for one user",
            ("economics",), ("computed", "simulated"),
            "Cost per million output tokens against the number of concurrent users for a dense model and a "
            "DeepSeek-V3-like mixture of experts (671B parameters, 37B active per token), from hardware figures you "
            "can edit; one decode step taken apart formula by formula, and the GPUs each model needs.",
            ("Cost per token is the price of the machines per second divided by the tokens they produce per "
             "second. A decode step gives every user one token and must read the weights those tokens use, plus "
             "each user's KV cache. With few users the reading sets the time, and it hardly changes with the "
             "number of users, so each added user spreads the same cost further, until the growing KV cache or "
             "the arithmetic takes over.",
             "DeepSeek-V3 has 671 billion parameters in 61 layers. In 58 of them the MLP is 256 routed experts "
             "plus one shared, and each token picks 8, so about 37 billion parameters work on any one token. But "
             "all 671 billion must sit in GPU memory: about ten GPUs of 80 GB at one byte per weight, deployed as "
             "two nodes of eight, paid for whether users keep them busy or not. On the widget's default hardware "
             "one user's tokens cost about twice those of a dense 70-billion-parameter model on a single GPU.",
             "Adding users does not help the MoE as quickly. A batch of B tokens reaches 256 × (1 - (1 - 8/256)^B) "
             "experts in each layer: 64 users already touch about 222 of the 256, so a step reads most of the "
             "weights, yet each expert sees only 64 × 8 / 256 = 2 tokens, a thin matrix again. Only with "
             "thousands of users is every expert busy; there the MoE's tokens cost about what the 70-billion "
             "model's do, for a model ten times larger, helped by its small latent KV cache (70 KB per token "
             "against 328 KB).",
             "A model that spans nodes is cut into pipeline stages, one per node. With p stages and m "
             "microbatches in flight, (p - 1) / (m + p - 1) of the time is idle: two stages with one microbatch "
             "idle half the time, and each extra microbatch reads the weights again. The widget prices every point "
             "on its cheapest mix of replicas and microbatches, from hardware figures you can edit (an H100-like "
             "GPU by default, assumed). These are simulated rooflines: upper bounds on speed, good for comparing "
             "the two models, not for quoting prices. Every formula and assumption is shown beside its number.")),
    Section(23, "mental-model", "The mental model to keep", (), (),
            "A summary of the walkthrough and its main nuances, each linked to the section whose widget shows "
            "it.",
            ("Pressing Send runs one prefill over the whole transcript, then one decode step per token of the "
             "answer, each step reading all the weights and the growing [KV cache](#kv-cache). Most of what a "
             "serving engine does is making each of those reads serve as many tokens as possible without making "
             "anyone wait too long. See [prefill and decode](#generation) and [the two phases](#phases).",
             "Can prompt tokens be batched? Yes, and they already are: prefill pushes a prompt's tokens through "
             "the weights together, and prompts from different requests can share one step, cut into chunks when "
             "long so that decoders are not stalled. See [the two phases](#phases) and [chunked "
             "prefill](#chunked-prefill).",
             "Is a batched token free? Nearly, while the step is limited by memory, since the weights are read "
             "once for all rows. Past the roofline's meeting point each row costs arithmetic, and larger batches "
             "slow every user's steps. See [batching into a matrix](#gemm) and [throughput against "
             "latency](#throughput-latency).",
             "Must lengths match? No. Continuous batching packs sequences of any length end to end, requests "
             "join and leave at every step, and block tables let each one hold just the memory it uses. See "
             "[static against continuous batching](#batching) and [paged KV](#paging).",
             "Why can local latency still be good? One user on their own machine faces no queue and shares no "
             "step, and a small model's weights are read quickly. What a lone user gives up is cost efficiency, "
             "not speed: the hardware sits idle between requests. See [the two phases](#phases), [the metric you "
             "care about](#slo) and [the economics of a giant MoE](#economics).",
             "Where does quality come from? From the weights, that is, from training. Batching, paging, prefix "
             "caching and chunking change speed and cost, not what the model says: in sendlens a batched request "
             "gives exactly the tokens it gives alone. What can change the words are the sampling settings and a "
             "lossy format for the weights. See [generation](#generation), [batching](#batching) and [efficiency "
             "tricks](#efficiency).")),
)

_BY_WIDGET = {name: section for section in SECTIONS for name in section.widgets}


def facts(info: dict) -> dict:
    """The running model's figures for the prose's {placeholders}, from the engine's info()."""
    real = info["model"].startswith("smollm2-135m")
    embedding = info["vocab_size"] * info["hidden_size"]
    return {**info,
            "model_label": ("SmolLM2-135M-Instruct" + (" (cut into experts)" if "moe" in info["model"] else "")
                            if real else f"the {info['model']} model"),
            "moe_expert_units": info["intermediate_size"] // 16,   # the moe widget's 16 experts
            "group": info["num_heads"] // info["num_kv_heads"],
            "rope_pairs": info["head_dim"] // 2,
            "kv_values_per_token": 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"],
            "kv_context_mb": info["kv_bytes_per_token"] * info["context_window"] / 1e6,
            "weights_mb": info["num_params"] * info.get("bytes_per_weight", 4) / 1e6,
            "embedding_params_m": embedding / 1e6,
            "embedding_share": f"{embedding / info['num_params']:.0%}",
            "block_size_minus_one": info["block_size"] - 1,
            "allreduces_per_pass": 2 * info["num_layers"],
            **tensor_parallel_degrees(info["num_heads"], info["num_kv_heads"])}


def tensor_parallel_degrees(num_heads: int, num_kv_heads: int, up_to: int = 4) -> dict:
    """The degrees up to `up_to` that split the heads into whole groups, and those refused, in words."""
    from core.parallel.tensor_parallel import split_error

    def words(ns: list[int]) -> str:
        return " and ".join(map(str, ns)) if len(ns) < 3 else ", ".join(map(str, ns[:-1])) + f" and {ns[-1]}"

    heads = SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads)
    ok = [n for n in range(1, up_to + 1) if split_error(heads, n) is None]
    refused = [n for n in range(1, up_to + 1) if n not in ok]
    note = (f"the widget shows {words(refused)} but refuses to run {'them' if len(refused) > 1 else 'it'}"
            if refused else f"every degree up to {up_to} runs")
    return {"tp_degrees": words(ok), "tp_refused_note": note}


def by_widget(name: str) -> Section | None:
    """The section that shows widget `name`, or None if no section embeds it."""
    return _BY_WIDGET.get(name)
