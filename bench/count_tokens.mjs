// Counts the real tokens of the prompts `python -m bench.estimate --learn` replays, and
// writes them to bench/estimate_counts.json (committed: the bench runs without npm).
//
//   mkdir -p /tmp/tok && cd /tmp/tok && npm install gpt-tokenizer@4.0.0 @anthropic-ai/tokenizer@0.0.4
//   NODE_PATH=/tmp/tok/node_modules node bench/count_tokens.mjs        (from the repository root)
//
// gpt-tokenizer bundles OpenAI's o200k_base and cl100k_base encodings (exact, no download);
// @anthropic-ai/tokenizer is Anthropic's published (Claude 2 era) tokenizer, a second
// provider's vocabulary. Each prompt is a slice of one corpus in bench/estimate_corpora/
// (the corpus repeated when the slice is longer than it), its length log-uniform in the
// corpus's range, from a seeded generator: the same file on every run.
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";

const require = createRequire(path.join(process.env.NODE_PATH || process.cwd(), "x.js"));
const { encode: o200k } = require("gpt-tokenizer/cjs/encoding/o200k_base");
const { encode: cl100k } = require("gpt-tokenizer/cjs/encoding/cl100k_base");
const { countTokens: claude } = require("@anthropic-ai/tokenizer");

const HERE = path.dirname(new URL(import.meta.url).pathname);
// corpus: [file, shortest and longest prompt in characters]
const CORPORA = {
  english: ["en.md", 300, 24000],
  code: ["code.py.txt", 300, 24000],
  json: ["data.json", 300, 12000],
  korean: ["ko.txt", 80, 6000],
  chinese: ["zh.txt", 80, 6000],
  japanese: ["ja.txt", 80, 6000],
};
const PROMPTS = 300;  // a corpus

function mulberry32(seed) {
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const random = mulberry32(33);
const out = {
  about: "Real token counts of slices of bench/estimate_corpora/, written by "
    + "bench/count_tokens.mjs (gpt-tokenizer 4.0.0, @anthropic-ai/tokenizer 0.0.4); "
    + "prompts: [start, length in characters, o200k_base, cl100k_base, claude] of the "
    + "corpus repeated end to end.",
  encodings: ["o200k_base", "cl100k_base", "claude"],
  corpora: {},
};
for (const [name, [file, shortest, longest]] of Object.entries(CORPORA)) {
  const text = readFileSync(path.join(HERE, "estimate_corpora", file), "utf8");
  if ([...text].length !== text.length) throw new Error(`${file}: characters beyond the BMP`);
  const prompts = [];
  for (let i = 0; i < PROMPTS; i++) {
    const length = Math.round(shortest * Math.pow(longest / shortest, random()));
    const start = Math.floor(random() * text.length);
    const slice = text.repeat(Math.ceil((start + length) / text.length) + 1)
      .slice(start, start + length);
    prompts.push([start, length, o200k(slice).length, cl100k(slice).length, claude(slice)]);
  }
  out.corpora[name] = { file, prompts };
}
const lines = JSON.stringify(out, null, 1).replace(/\[\s+(-?\d+),\s+(-?\d+),\s+(-?\d+),\s+(-?\d+),\s+(-?\d+)\s+\]/g, "[$1, $2, $3, $4, $5]");
writeFileSync(path.join(HERE, "estimate_counts.json"), lines + "\n");
console.log("wrote bench/estimate_counts.json");
