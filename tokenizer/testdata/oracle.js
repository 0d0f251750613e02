// HF reference oracle: node oracle.js TOKENIZER_JSON TEXTS_JSON > IDS_JSON
// Prints, for each text of the JSON array TEXTS_JSON, the ids of
// tokenizer.encode(text, { addSpecialTokens: false }) as a JSON array of arrays.
// Needs tokenizers@0.23.2 (HF's node binding), found through NODE_PATH.
'use strict';
const { Tokenizer } = require('tokenizers');
const fs = require('fs');

(async () => {
  const tok = Tokenizer.fromFile(process.argv[2]);
  const texts = JSON.parse(fs.readFileSync(process.argv[3], 'utf8'));
  const out = [];
  for (const t of texts) {
    const enc = await tok.encode(t, null, { addSpecialTokens: false });
    out.push(Array.from(enc.getIds()));
  }
  process.stdout.write(JSON.stringify(out));
})().catch((e) => { console.error(e); process.exit(1); });
