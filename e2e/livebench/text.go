package livebench

import (
	"strings"
	"sync"
)

// wordList holds 512 common English words, each a single token (with its
// leading space) for the Qwen3 tokenizer and, being common English, about
// one token for most BPE vocabularies; the simulator's whitespace
// tokenizer counts each as exactly one. Averaging 5.4 characters with the
// space, a prompt of n trace tokens is about 5.4·n bytes.
const wordList = `
the of and to in is it you that he was for on are with as his they be at one have this from or had
by word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live where after back
little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four between state
keep eye never last let thought city tree cross farm hard start might story saw far sea draw left
late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once base
hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red
list though feel talk bird soon body dog family direct pose leave song measure door product black
short numeral class wind question happen complete ship area half rock order fire south problem piece
told knew pass since top whole king space heard best hour better true during hundred five remember
step early hold west ground interest reach fast verb sing listen six table travel less morning ten
simple several toward war lay against pattern slow center love person money serve appear road map
rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine
note wait plan figure star box noun field rest correct able pound done beauty drive stood contain
front teach week final gave green quick develop ocean warm free minute strong special mind behind
clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane stead dry
wonder laugh thousand ago ran check game shape hot miss brought heat snow tire bring yes distant
fill east paint language among grand ball yet wave drop heart present heavy dance engine position
arm wide sail material size vary settle speak
`

// vocabulary is wordList split; its length is a power of two.
var vocabulary = sync.OnceValue(func() []string { return strings.Fields(wordList) })

// Word is the word a trace token renders as. Trace tokens are the
// synthetic token ids of routing/sim/trace (a pseudo-random stream per
// Mooncake hash id, per agentic system prompt, per turn), so the words of
// a hash id's block are a deterministic function of the hash id.
func Word(token uint32) string {
	v := vocabulary()
	// The low bits of the mixed token pick the word: trace tokens are
	// already pseudo-random, mixing again only guards against a stream
	// whose low bits repeat.
	return v[mix32(token)&uint32(len(v)-1)]
}

func mix32(x uint32) uint32 {
	x ^= x >> 16
	x *= 0x7feb352d
	x ^= x >> 15
	x *= 0x846ca68b
	return x ^ x>>16
}

// AppendText appends the text of tokens to dst: one word per token,
// separated by single spaces. The text of a prefix of tokens is a prefix
// of the text of tokens, so requests that share trace tokens (a Mooncake
// hash id, an agentic session's history) share the same text.
func AppendText(dst []byte, tokens []uint32) []byte {
	for i, t := range tokens {
		if i > 0 {
			dst = append(dst, ' ')
		}
		dst = append(dst, Word(t)...)
	}
	return dst
}

// Text is the text of tokens (see [AppendText]).
func Text(tokens []uint32) string { return string(AppendText(nil, tokens)) }
